"""Data parallelism: D copies of the pipeline, each stage's gradients all-reduced across them.

With `--dp D` the world is p·D ranks; every copy runs the same programs on its own share of the
batch. This pass adds `ALLREDUCE_GRADS s=X` (no peer: the stage's data-parallel group) right
after the last backward op of each stage, so the all-reduce is issued eagerly and overlaps the
rank's remaining compute; the runtime waits for it at OPTIMIZER_STEP.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def dp_sync_error(programs: Sequence[Program], dp: int) -> str | None:
    """Why the programs do not all-reduce each stage's gradients across the `dp` copies exactly
    once, after the stage's last backward op, if they do not (none at all when dp == 1): a
    missing or early sync trains each copy on its own share of the batch without a word."""
    for r, prog in enumerate(programs):
        last = {i.stage: k for k, i in enumerate(prog) if i.op in BACKWARD_OPS}
        synced: set[int] = set()
        for k, instr in enumerate(prog):
            if instr.op is not Op.ALLREDUCE_GRADS or instr.peer is not None:  # a replica's
                continue
            where = f"rank {r}, instruction {k} ({instr})"
            if dp == 1:
                return f"{where}: a data-parallel sync in a build without --dp"
            if instr.stage not in last:
                return f"{where}: stage {instr.stage} has no backward on this rank"
            if instr.stage in synced:
                return f"{where}: appears more than once"
            if k < last[instr.stage]:
                return (
                    f"{where}: before the stage's last backward op (instruction "
                    f"{last[instr.stage]}), so it would sum incomplete gradients"
                )
            synced.add(instr.stage)
        missing = sorted(set(last) - synced) if dp > 1 else []
        if missing:
            return (
                f"rank {r}: stage {missing[0]} has no ALLREDUCE_GRADS across its {dp} "
                "data-parallel copies"
            )
    return None
