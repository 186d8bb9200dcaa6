"""Data parallelism: D copies of the pipeline, each stage's gradients all-reduced across them.

With `--dp D` the world is p·D ranks; every copy runs the same programs on its own share of the
batch. This pass adds `ALLREDUCE_GRADS s=X` (no peer: the stage's data-parallel group) right
after the last backward op of each stage, so the all-reduce is issued eagerly and overlaps the
rank's remaining compute; the runtime waits for it at OPTIMIZER_STEP.
"""

from __future__ import annotations

from pipec.ir import Compiled, Instr, Op, Program

BACKWARD_OPS = frozenset({Op.B, Op.W, Op.BW})


def add_dp_sync(compiled: Compiled) -> Compiled:
    """Insert one ALLREDUCE_GRADS per stage after that stage's last B/W/BW; nothing else moves."""
    return Compiled(
        compiled.schedule,
        compiled.p,
        compiled.m,
        compiled.v,
        compiled.layout,
        tuple(_with_sync(program) for program in compiled.programs),
    )


def _with_sync(program: Program) -> Program:
    last = {instr.stage: k for k, instr in enumerate(program) if instr.op in BACKWARD_OPS}
    after = {k: s for s, k in last.items()}
    out: list[Instr] = []
    for k, instr in enumerate(program):
        out.append(instr)
        if k in after:
            out.append(Instr(Op.ALLREDUCE_GRADS, after[k]))
    return tuple(out)
