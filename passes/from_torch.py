"""Import: torch.distributed.pipelining per-rank actions as a pipec `Schedule`.

Expects one row of actions per rank (row r is rank r); communication, UNSHARD/RESHARD and
REDUCE_GRAD are dropped, because pipec lowers its own messages from the compute orders, and an
OVERLAP_F_B runs its sub-actions in order (as torch's runtime does). Guarantees a schedule with
one pipeline, stages 0..S-1 in a chain, each stage on the one rank that runs it (so looped and
V placements are inferred, not assumed) and micro-batches 0..m-1. torch's F, I, W become F, B, W;
its full backward B becomes a fused BW, also in a schedule that splits other backwards (DualPipeV
mixes both; pipec's work graph holds the mix, see `pipec.ir.fused_backwards`).
Refuses, with one line, a stage on two ranks, a missing stage, ranks holding different numbers
of stages, and forwards that do not cover micro-batches 0..m-1 once per stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipec.ir import Instr, Op, PipecError, Schedule, single_pipeline
from pipec.torch_csv import COMPUTE_TYPES, Action, Cell

OPS = {"F": Op.F, "I": Op.B, "W": Op.W, "B": Op.BW}


def compute_actions(rows: Sequence[Sequence[Cell]]) -> list[list[Action]]:
    """Each rank's compute actions in execution order (overlapped pairs flattened)."""
    return [[a for cell in row for a in cell if a.type in COMPUTE_TYPES] for row in rows]


def _stage_ranks(actions: list[list[Action]], source: str) -> tuple[int, ...]:
    rank_of: dict[int, int] = {}
    for r, row in enumerate(actions):
        if not row:
            raise PipecError(f"{source}: rank {r} runs no compute action; every rank needs a stage")
        for a in row:
            if rank_of.setdefault(a.stage, r) != r:
                raise PipecError(
                    f"{source}: stage {a.stage} runs on rank {rank_of[a.stage]} and rank {r}; "
                    "a stage lives on one rank"
                )
    n = max(rank_of) + 1
    missing = sorted(set(range(n)) - set(rank_of))
    if missing:
        raise PipecError(
            f"{source}: stage(s) {missing} never run, though stages go up to {n - 1}; "
            "torch's pipeline is one chain of stages 0..S-1"
        )
    counts = [sum(1 for s in range(n) if rank_of[s] == r) for r in range(len(actions))]
    if len(set(counts)) != 1:
        raise PipecError(
            f"{source}: ranks hold different numbers of stages ({counts}); pipec needs v "
            "stages on every rank"
        )
    return tuple(rank_of[s] for s in range(n))


def _microbatches(actions: list[list[Action]], n_stages: int, source: str) -> int:
    forwards: list[list[int]] = [[] for _ in range(n_stages)]
    for row in actions:
        for a in row:
            if a.type == "F":
                forwards[a.stage].append(a.mb)
    m = 1 + max(mb for fs in forwards for mb in fs) if any(forwards) else 0
    for s, fs in enumerate(forwards):
        if sorted(fs) != list(range(m)):
            raise PipecError(
                f"{source}: stage {s} runs forwards for micro-batches {sorted(fs)}; "
                f"expected each of 0..{m - 1} once"
            )
    return m


def schedule_from_torch(name: str, rows: Sequence[Sequence[Cell]], source: str) -> Schedule:
    """The pipec schedule that runs torch's per-rank compute orders `rows`."""
    actions = compute_actions(rows)
    stage_rank = _stage_ranks(actions, source)
    p, n_stages = len(actions), len(stage_rank)
    m = _microbatches(actions, n_stages, source)
    orders = tuple(tuple(Instr(OPS[a.type], a.stage, a.mb) for a in row) for row in actions)
    return Schedule(name, p, m, n_stages // p, single_pipeline(p, m, stage_rank), orders)
