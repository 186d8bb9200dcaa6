"""Compute handlers: F, B, W, fused BW and RECOMPUTE of one (stage, mb).

F takes its input (the micro-batch on a first stage, a local hand-off when the previous stage
is on this rank, else the posted receive), runs the stage under the stash's saved-tensor hooks
the first time (later steps reuse the byte count, unless the stash is evicted; the last stage
adds the loss, scaled 1/(m·D)) and leaves its output for SEND_ACT or the next
local stage. A stage whose forward will be recomputed runs F without autograd and keeps only
its inputs. B/BW take the output gradient the same three ways, run the backward (B through
runtime.bwsplit, queueing the Linear weight-gradient GEMMs for W) and leave the input gradient
for SEND_GRAD or the previous local stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pipec.ir import Instr, Op
from pipec.runtime import bwsplit
from pipec.runtime.offload import finish_load
from pipec.runtime.p2p import Kind
from pipec.runtime.stash import SavedTensors, Stash, tensors_nbytes

if TYPE_CHECKING:
    from pipec.runtime.rank import Rank


def incoming(rt: Rank, kind: Kind, producer: int, mb: int) -> tuple[Tensor, ...]:
    """A message from `producer`: handed over locally if it ran here, else received."""
    if rt.layout.stage_rank[producer] == rt.rank:
        return rt.step_state.local.pop((kind, producer, mb))
    return rt.comm.take(kind, producer, mb)


def outgoing(rt: Rank, kind: Kind, stage: int, mb: int, to: int, tensors: tuple[Tensor, ...]):
    """Leave tensors for stage `to`: locally if it runs here, else for the SEND instruction."""
    box = rt.step_state.local if rt.layout.stage_rank[to] == rt.rank else rt.step_state.outbox
    box[(kind, stage, mb)] = tensors


def _run(rt: Rank, stage: int, mb: int, inputs: tuple[Tensor, ...], record: bool):
    """The stage's forward; on the last stage, the scaled loss (recorded unscaled)."""
    with bwsplit.unsplit(rt.modules[stage], (stage, mb) in rt.marks.fused):
        out = rt.modules[stage](*inputs)
    if rt.layout.next_stage(stage) is not None:
        return (out,) if isinstance(out, Tensor) else tuple(out)
    loss = rt.spec.loss_fn(out, rt.batch(mb)[1])
    if record:
        rt.step_state.losses[mb] = loss.detach()
    return (loss * rt.loss_scale,)


def _leaves(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Stage inputs as autograd leaves: floating ones collect their gradient in .grad; integer
    and bool ones (token ids, masks) are plain inputs."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in tensors)


def forward(rt: Rank, instr: Instr) -> None:
    s, mb = instr.stage, instr.mb
    prev = rt.layout.prev_stage(s)
    received = rt.batch(mb)[0] if prev is None else incoming(rt, Kind.ACT, prev, mb)
    inputs = _leaves(received)
    if (s, mb) in rt.marks.recomputed:
        with torch.no_grad():
            outputs = _run(rt, s, mb, inputs, record=True)
        stash = Stash(inputs, None, None, tensors_nbytes(inputs))
    elif (s, mb) in rt.stash_bytes.sizes:
        # Counted under the hooks in an earlier step: autograd saves the same tensors every
        # step, and the hooks cost ~2 us per saved tensor (8-10% of a tiny GPT stage's F+B).
        outputs = _run(rt, s, mb, inputs, record=True)
        stash = Stash(inputs, outputs, None, rt.stash_bytes.sizes[(s, mb)])
    else:
        saved = SavedTensors(rt.param_keys[s])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            outputs = _run(rt, s, mb, inputs, record=True)
        stash = Stash(inputs, outputs, saved, saved.nbytes)
        if (s, mb) not in rt.marks.evicted:  # an evicted stash needs its saved tensors every step
            rt.stash_bytes.sizes[(s, mb)] = saved.nbytes
    rt.step_state.stashes[(s, mb)] = stash
    rt.stash_bytes.account(stash.nbytes)
    nxt = rt.layout.next_stage(s)
    if nxt is not None:
        outgoing(rt, Kind.ACT, s, mb, nxt, tuple(o.detach() for o in outputs))


def recompute(rt: Rank, instr: Instr) -> None:
    """Re-run F(s, mb) from its stashed inputs, this time keeping what the backward needs."""
    s, mb = instr.stage, instr.mb
    stash = rt.step_state.stashes[(s, mb)]
    if stash.loading:
        finish_load(rt, s, mb, stash)
    inputs = _leaves(stash.inputs)
    saved = SavedTensors(rt.param_keys[s])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        stash.outputs = _run(rt, s, mb, inputs, record=False)
    stash.inputs, stash.saved = inputs, saved
    extra = saved.nbytes + tensors_nbytes(inputs) - stash.nbytes
    stash.nbytes += extra
    rt.stash_bytes.account(extra)


def backward(rt: Rank, instr: Instr) -> None:
    """B (input gradients; weight gradients queued for W) or fused BW of (s, mb)."""
    s, mb = instr.stage, instr.mb
    stash = rt.step_state.stashes.pop((s, mb))
    if stash.loading:
        finish_load(rt, s, mb, stash)
    nxt = rt.layout.next_stage(s)
    if nxt is None:
        outputs, grads = list(stash.outputs), None
    else:
        # Gradients come for the floating outputs only (Rank.boundary), in order.
        received = incoming(rt, Kind.GRAD, nxt, mb)
        floating = [o for o in stash.outputs if o.is_floating_point()]
        pairs = [(o, g) for o, g in zip(floating, received, strict=True) if o.requires_grad]
        outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    module = rt.modules[s]
    held = 0
    if instr.op is Op.B:
        input_grads = bwsplit.B(module, mb, outputs, grads, stash.inputs)
        held = rt.step_state.held[(s, mb)] = bwsplit.held_bytes(module, mb)
    else:
        torch.autograd.backward(outputs, grads)
        input_grads = tuple(x.grad if x.requires_grad else None for x in stash.inputs)
    # One net change, as the simulator counts B: what W still needs (the Linear inputs) shares
    # storages with the stash, so adding it before releasing the stash counted them twice and
    # made a transient peak of stash + held that no op-level model has.
    rt.stash_bytes.account(held - stash.nbytes)
    prev = rt.layout.prev_stage(s)
    if prev is not None:
        sent = tuple(
            torch.zeros_like(x) if g is None else g
            for x, g in zip(stash.inputs, input_grads)
            if x.is_floating_point()
        )
        outgoing(rt, Kind.GRAD, s, mb, prev, sent)


def weight_grad(rt: Rank, instr: Instr) -> None:
    """W(s, mb): the queued weight-gradient GEMMs of the micro-batch, into .grad."""
    bwsplit.W(rt.modules[instr.stage], instr.mb)
    rt.stash_bytes.account(-rt.step_state.held.pop((instr.stage, instr.mb)))
