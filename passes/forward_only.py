"""Evaluation programs: each rank's forwards and activation messages, in training order.

Evaluation runs the model forward only (the loss on the last stage, no gradients), so its
program per rank is the training program less everything a forward does not need: backward
work (B, W, BW, RECOMPUTE), gradient messages, stash moves, gradient syncs and the optimizer
step. What remains keeps the training program's order, so the micro-batches flow through the
same placement; `verify_forward` proves the result as the verifier proves a training program:
every F exactly once on its stage's rank, nothing but forwards and activation messages, and no
deadlock under blocking point-to-point (passes/execution.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipec.ir import Compiled, Op, Program
from pipec.passes.execution import check_execution
from pipec.passes.violation import VerifyError, at

#: The ops an evaluation program keeps.
FORWARD_OPS = frozenset({Op.F, Op.SEND_ACT, Op.RECV_ACT})


def forward_only(programs: Sequence[Program]) -> tuple[Program, ...]:
    """Each program's F, SEND_ACT and RECV_ACT, in their order."""
    return tuple(tuple(i for i in prog if i.op in FORWARD_OPS) for prog in programs)


def verify_forward(compiled: Compiled) -> None:
    """Raise VerifyError unless `compiled`'s programs are a valid forward-only pass: only
    FORWARD_OPS, F of every (stage, micro-batch) of every pipeline exactly once on its stage's
    rank, matched activation messages and no deadlock."""
    layout = compiled.layout
    if len(compiled.programs) != layout.p:
        raise VerifyError(f"{len(compiled.programs)} programs for a {layout.p}-rank layout")
    expected = {(s, i) for pl in layout.pipelines for s in pl.stages for i in pl.mbs}
    seen: set[tuple[int, int]] = set()
    for r, prog in enumerate(compiled.programs):
        for pos, instr in enumerate(prog):
            if instr.op not in FORWARD_OPS:
                raise VerifyError(f"{at(r, pos, instr)}: not a forward or activation message")
            if instr.op is not Op.F:
                continue
            node = (instr.stage, instr.mb)
            if node not in expected:
                raise VerifyError(f"{at(r, pos, instr)}: not an op of the work graph")
            if node in seen:
                raise VerifyError(f"{at(r, pos, instr)}: appears more than once")
            if layout.stage_rank[instr.stage] != r:
                raise VerifyError(
                    f"{at(r, pos, instr)}: stage {instr.stage} is mapped to rank "
                    f"{layout.stage_rank[instr.stage]}"
                )
            seen.add(node)
    missing = sorted(expected - seen)
    if missing:
        s, i = missing[0]
        raise VerifyError(
            f"rank {layout.stage_rank[s]}: F s={s} mb={i} is missing "
            f"({len(missing)} forwards missing in all)"
        )
    check_execution(compiled, training=False)
