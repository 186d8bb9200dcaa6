"""Evaluation: the mean loss of the model on `ModelSpec.eval_data`, between training steps.

Each rank executes its evaluation program (eval_rank_XXX.pipe: its training program's forwards
and activation messages, passes/forward_only.py) through the interpreter, once per evaluation
batch, with its own handlers: F runs the stage without autograd and, on a last stage, records
the loss; the messages are training's. Evaluation leaves training as it found it: the stages
run in eval mode (dropout off) under `torch.no_grad` and go back to their mode after; batches
come from a stream of their own, the same first N batches every time (so evaluations compare);
no random number is drawn; the rank's program, data and per-step state are restored. The one
collective is the sum of the losses at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from pipec.build_dir import eval_file
from pipec.ir import Instr, Op
from pipec.runtime import p2p
from pipec.runtime.compute import incoming, outgoing
from pipec.runtime.data import Stream
from pipec.runtime.faults import Watchdog
from pipec.runtime.interpreter import Handler, run_program
from pipec.runtime.rank import Rank

if TYPE_CHECKING:
    from pipec.runtime.metrics import Metrics


def forward(rt: Rank, instr: Instr) -> None:
    """F(s, mb) without autograd: its output goes on; a last stage records the loss."""
    s, mb = instr.stage, instr.mb
    prev, nxt = rt.layout.prev_stage(s), rt.layout.next_stage(s)
    inputs = rt.batch(mb)[0] if prev is None else incoming(rt, p2p.Kind.ACT, prev, mb)
    out = rt.modules[s](*inputs)
    if nxt is None:
        rt.step_state.losses[mb] = rt.spec.loss_fn(out, rt.batch(mb)[1])
    else:
        outgoing(rt, p2p.Kind.ACT, s, mb, nxt, (out,) if isinstance(out, Tensor) else tuple(out))


HANDLERS: Mapping[Op, Handler] = {
    Op.F: forward,
    Op.SEND_ACT: p2p.send_act,
    Op.RECV_ACT: p2p.recv_act,
}


def evaluate(rt: Rank, batches: int, watchdog: Watchdog) -> float:
    """The mean loss over the micro-batches of eval_data's first `batches` global batches;
    every rank calls it at the same point and gets the same value."""
    modes = {s: m.training for s, m in rt.modules.items()}
    total, count = torch.zeros((), dtype=torch.float64, device=rt.device), 0
    program, source = rt.build.eval_programs[rt.rank], eval_file(rt.rank)
    data = Stream(rt.spec, rt.layout.m * rt.dp, 0, "eval_data")
    describe, step = watchdog.describe, rt.step
    try:
        watchdog.describe = lambda k: rt.describe(k).replace(rt.source, source)
        for module in rt.modules.values():
            module.eval()
        with rt.evaluating(program, data), torch.no_grad():
            for _ in range(batches):
                rt.new_step(step)  # the training step's number: no optimizer step here
                run_program(rt, HANDLERS, watchdog)
                rt.comm.complete()  # no optimizer step drains the sends
                total += rt.loss_sums()[0]
                count += len(rt.step_state.losses)
    finally:
        watchdog.describe = describe
        for s, module in rt.modules.items():
            module.train(modes[s])
    sums = torch.stack((total, torch.tensor(float(count), dtype=torch.float64, device=rt.device)))
    dist.all_reduce(sums)
    loss_sum, n = sums.tolist()
    return loss_sum / n


def evaluator(
    rt: Rank, every: int, batches: int, watchdog: Watchdog, metrics: Metrics | None
) -> Callable[[int], None] | None:
    """After every `every` steps (0: never), the mean loss of `batches` evaluation batches,
    for rank 0's log."""
    if not every:
        return None

    def after(step: int) -> None:
        if step % every == 0:
            loss = evaluate(rt, batches, watchdog)
            if metrics:
                metrics.eval(step, loss, batches)

    return after
