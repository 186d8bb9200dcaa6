"""Gradient synchronisation and the optimizer step.

ALLREDUCE_GRADS s=X to=Q sums stage X's gradients with its replica on rank Q (bidirectional
schedules); without a peer it sums them over the stage's data-parallel group. Either way the
gradients are flattened into one buffer and all-reduced asynchronously, so the reduction
overlaps whatever the program does next; OPTIMIZER_STEP waits for it. A parameter shared by two
stages of one rank is reduced once per step.

OPTIMIZER_STEP completes the sends, waits for the reductions, sums the gradients of parameters
tied across ranks (an embedding and its LM head), steps the optimizer (runtime/optim.py: the
norm, clipping, the non-finite guard, ZeRO-1's reduce-scatter) and zeroes the gradients; then
every stash, message and deferred weight gradient of the step must be gone. Under bf16 the
gradients reduced are the fp32 `main_grad`s (runtime/precision.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipec.ir import Instr
from pipec.runtime.precision import grad_of, set_grad

if TYPE_CHECKING:
    from pipec.runtime.rank import Rank


def _grads(params) -> list[torch.Tensor]:
    """The gradients to reduce (`grad_of`: fp32 under bf16), zeros for a parameter without one."""
    out = []
    for p in params:
        g = grad_of(p)
        if g is None:
            g = torch.zeros_like(p, dtype=torch.float32 if hasattr(p, "main_grad") else p.dtype)
        out.append(g)
    return out


def allreduce_grads(rt: Rank, instr: Instr) -> None:
    if instr.peer is None:
        if rt.zero:
            return  # ZeRO-1 reduce-scatters the data-parallel sum at the step (runtime/optim.py)
        group = rt.groups.dp
    else:
        group = rt.groups.replicas[(instr.peer, rt.layout.stage_chunk[instr.stage])]
    if group is None:
        return  # data parallelism of one: nothing to sum
    params = [p for p in rt.stage_parameters(instr.stage) if id(p) not in rt.step_state.synced]
    rt.step_state.synced.update(id(p) for p in params)
    flat = _flatten_dense_tensors(_grads(params))
    work = dist.all_reduce(flat, group=group, async_op=True)
    rt.step_state.reductions.append((work, flat, params))


def _finish(params, flat: torch.Tensor) -> None:
    for p, g in zip(params, _unflatten_dense_tensors(flat, _grads(params))):
        set_grad(p, g)


def optimizer_step(rt: Rank, instr: Instr) -> None:
    rt.comm.drain()
    for work, flat, params in rt.step_state.reductions:
        work.wait(rt.comm.timeout)
        _finish(params, flat)
    for group, param in rt.groups.tied:
        flat = _flatten_dense_tensors(_grads([param]))
        dist.all_reduce(flat, group=group)
        _finish([param], flat)
    rt.step_state.stepped(rt.optimizer.step())
    rt.optimizer.zero_grad(set_to_none=True)
    _check_step_is_over(rt)


def _check_step_is_over(rt: Rank) -> None:
    """Anything left from this step means the program is wrong; say what."""
    left = {
        "stashes": list(rt.step_state.stashes),
        "unsent or unconsumed tensors": list(rt.step_state.outbox) + list(rt.step_state.local),
        "deferred weight gradients (W missing) or accepted stashes": list(rt.step_state.held),
    }
    for what, keys in left.items():
        if keys:
            raise RuntimeError(f"the step ended with {what} left: {keys[:4]}")
    rt.step_state.reductions.clear()
    rt.step_state.synced.clear()
