"""BPipe's memory ops: EVICT/LOAD on the evictor, ACCEPT/RETURN on the acceptor.

Both sides know a stash's size from the plan: the flat buffer holds the stash's storages back
to back, so it is exactly the stage's measured stash bytes (its input bytes when the forward is
recomputed, see `buffer_bytes`). The plan measured them in the model's own dtype; a run in
another (`--precision bf16`) measures its own before the first step (`size_moves`).

EVICT packs the stash into that buffer (runtime/stash.py), frees the stash's storages here
and sends the buffer (non-blocking; the buffer goes as soon as the send completes). ACCEPT
allocates the buffer and posts its receive; RETURN sends it back, and the acceptor holds it
until that send completes. LOAD allocates a buffer and posts the receive of the stash coming
back; the backward (or RECOMPUTE) that needs it waits, refills the stash's storages from it
and drops it, so a loaded buffer lives from its LOAD to its backward.
A forward that will be recomputed kept only its inputs: those are what EVICT moves.

A move out completes only once the partner has posted its half (ACCEPT, LOAD). So that the
bytes a rank gave away are gone before it takes new ones, a rank waits for its moves out to
complete before any instruction that allocates stash bytes (`ALLOCATES`, defined beside the
prediction that models it; the interpreter calls `settle`). The verifier proves the programs
deadlock-free with every stash move blocking until its partner arrives, so this weaker wait
cannot deadlock; it costs time only where the partner is late, and it makes the memory limit
a bound on the real bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipec.ir import Instr, Op
from pipec.passes.simulate import uses_recompute
from pipec.runtime.p2p import Kind
from pipec.runtime.stash import SavedTensors, Stash, storage_key, tensors_nbytes

if TYPE_CHECKING:
    from pipec.runtime.rank import Rank


_MOVES_OUT = frozenset({Kind.STASH, Kind.STASH_BACK})


def settle(rt: Rank) -> None:
    """Wait for this rank's stash moves out (EVICT's and RETURN's sends) to complete."""
    if any(out.key[0] in _MOVES_OUT for out in rt.comm.in_flight):
        rt.comm.complete(_MOVES_OUT)


def buffer_bytes(rt: Rank, stage: int, mb: int) -> int:
    """Bytes of (stage, mb)'s flat stash buffer, from the plan (or `size_moves`): what the
    evictor packs and the acceptor allocates, without a message saying it."""
    chunk = rt.layout.stage_chunk[stage]
    if moved := rt.stash_bytes.moved:
        return moved[chunk]
    recomputed = uses_recompute(rt.build.compiled.programs)  # all of a build's stages or none
    facts = rt.build.costs.input_bytes if recomputed else rt.build.costs.stash_bytes
    return int(facts[chunk])


def size_moves(rt: Rank) -> tuple[int, ...]:
    """A stash move's bytes per chunk, unless the plan's stash bytes are this run's (then
    none, `()`, on every rank; `Rank.connect` keeps them): the plan's were measured in the
    model's own dtype, and priced from there for `pipec compile --precision bf16`, but a
    bf16 stash is not simply half an fp32 one (integer ids, a loss upcast to fp32). Each rank
    measures the stashes of its own stages as F makes them, on zeros of the boundary's shapes
    and run dtypes, and every rank takes the world's figure per chunk (one all-reduce before the
    first step), so that an evictor and its acceptor allocate the same buffer. Builds that evict
    nothing skip it, on every rank."""
    programs = rt.build.compiled.programs
    measured = rt.compute_dtype is None and rt.build.plan.get("precision", "fp32") == "fp32"
    if measured or not any(i.op is Op.EVICT for prog in programs for i in prog):
        return ()
    recomputed = uses_recompute(programs)
    sizes = torch.zeros(len(rt.build.costs.stash_bytes), dtype=torch.int64, device=rt.device)
    for stage in rt.modules:
        received = tuple(
            torch.zeros(shape, dtype=dtype, device=rt.device)
            for shape, dtype in rt.boundary(stage, "inputs")
        )
        chunk = rt.layout.stage_chunk[stage]
        sizes[chunk] = tensors_nbytes(received) if recomputed else _stash_bytes(rt, stage, received)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    return tuple(sizes.tolist())


def _stash_bytes(rt: Rank, stage: int, received: tuple[torch.Tensor, ...]) -> int:
    """The frontend's measure of `stage`'s stash (what EVICT packs: autograd's saved storages
    but the parameters'), on `received`, leaving no trace: the random state (dropout) and the
    buffers (batch-norm statistics) are put back."""
    from pipec.frontend import measure_stash_bytes  # as the plan measured it

    module = rt.modules[stage]
    buffers = [(b, b.clone()) for b in module.buffers()]
    last = rt.layout.next_stage(stage) is None
    target = rt.spec.example_target.to(rt.device)
    devices = [rt.device] if rt.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        n = measure_stash_bytes(
            module, received, (lambda y: rt.spec.loss_fn(y, target)) if last else None
        )
    with torch.no_grad():
        for b, kept in buffers:
            b.copy_(kept)
    return n


def _stash(rt: Rank, instr: Instr) -> Stash:
    stash = rt.step_state.stashes.get((instr.stage, instr.mb))
    if stash is None:
        raise RuntimeError(f"{instr}: no stash of s={instr.stage} mb={instr.mb} here to move")
    return stash


def _moved(stash: Stash) -> SavedTensors:
    """What EVICT moves: autograd's saved tensors, or the inputs of a forward that ran without
    autograd (to be recomputed)."""
    if stash.saved is None:
        stash.saved = SavedTensors(frozenset())
        for x in stash.inputs:
            stash.saved.pack(x)
    return stash.saved


def _still_read(rt: Rank) -> set[int]:
    """Storages something on this rank may still read before the stash is loaded back: the
    micro-batches' data, tensors waiting for a SEND or a local stage, sends in flight."""
    state = rt.step_state
    held = [t for inputs, target in state.batches.values() for t in (*inputs, target)]
    held += [t for box in (state.outbox, state.local) for ts in box.values() for t in ts]
    held += [t for out in rt.comm.in_flight for t in out.tensors]
    return {storage_key(t) for t in held}


def evict(rt: Rank, instr: Instr) -> None:
    """EVICT: pack the stash, free it here, send the buffer to the acceptor."""
    s, mb = instr.stage, instr.mb
    saved = _moved(_stash(rt, instr))
    buffer = saved.evict(buffer_bytes(rt, s, mb), keep=_still_read(rt))
    rt.comm.send(Kind.STASH, s, mb, instr.peer, [buffer])
    rt.stash_bytes.account(-saved.nbytes)


def accept(rt: Rank, instr: Instr) -> None:
    """ACCEPT: allocate the partner's stash buffer and post its receive."""
    s, mb = instr.stage, instr.mb
    n = buffer_bytes(rt, s, mb)
    rt.comm.post(Kind.STASH, s, mb, instr.peer, [((n,), torch.uint8)])
    rt.step_state.held[(s, mb)] = n
    rt.stash_bytes.account(n)


def give_back(rt: Rank, instr: Instr) -> None:
    """RETURN: send the held stash of (s, mb) back to its evictor."""
    s, mb = instr.stage, instr.mb
    buffer = rt.comm.take(Kind.STASH, s, mb)[0]
    rt.comm.send(Kind.STASH_BACK, s, mb, instr.peer, [buffer])
    rt.stash_bytes.account(-rt.step_state.held.pop((s, mb)))


def load(rt: Rank, instr: Instr) -> None:
    """LOAD: post the receive of the stash coming back (the backward waits for it)."""
    s, mb = instr.stage, instr.mb
    stash = _stash(rt, instr)
    rt.comm.post(Kind.STASH_BACK, s, mb, instr.peer, [((buffer_bytes(rt, s, mb),), torch.uint8)])
    stash.loading = True
    rt.stash_bytes.account(stash.saved.nbytes)


def finish_load(rt: Rank, stage: int, mb: int, stash: Stash) -> None:
    """Wait for a loaded stash and refill its storages (before their first use)."""
    stash.saved.restore(rt.comm.take(Kind.STASH_BACK, stage, mb)[0])
    stash.loading = False
    if stash.outputs is None:  # not recomputed yet: the inputs are back, nothing is saved
        stash.saved = None
