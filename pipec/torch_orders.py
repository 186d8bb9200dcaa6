"""Ask torch.distributed.pipelining for its own schedule order, without a process group.

torch builds `pipeline_order` (rank -> actions) in each schedule's constructor from nothing but
the stages' `num_stages`, `group_size` and `group_rank`, so stand-in stage objects suffice: no
model, no process group. The actions are read back through their printed form (torch's
`str(action)` is the CSV cell), so this path and a CSV file go through the same parser.
"""

from __future__ import annotations

from types import SimpleNamespace

from pipec.ir import PipecError
from pipec.torch_csv import Action, Cell, parse_cell

#: The classes torch exports that build a whole order (not the abstract bases).
CLASSES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
#: Those built on one stage object (torch's PipelineScheduleSingle), so one stage per rank.
SINGLE_STAGE = ("ScheduleGPipe", "Schedule1F1B")


def class_name(name: str) -> str:
    """torch's class name for `name` (case-insensitive, `Schedule` prefix optional)."""
    wanted = name.lower().removeprefix("schedule")
    for cls in CLASSES:
        if cls.lower().removeprefix("schedule") == wanted:
            return cls
    raise PipecError(f"unknown torch schedule '{name}'; valid: {', '.join(CLASSES)}")


def default_chunks(cls_name: str) -> int:
    """Stages per rank torch's class takes by default: 1 for its single-stage classes."""
    return 1 if cls_name in SINGLE_STAGE else 2


def _fix_1f1b_last_rank(rows: list[list[Cell]], m: int) -> list[str]:
    """torch 2.13's Schedule1F1B *prints* the last rank's forwards as 1..m (its runtime runs
    0..m-1; docs/interop.md): renumber them when exactly that pattern is present, and say so."""
    last = rows[-1]
    fwd = [c[0].mb for c in last if c[0].type == "F"]
    bwd = [c[0].mb for c in last if c[0].type == "B"]
    if fwd != list(range(1, m + 1)) or bwd != list(range(m)):
        return []
    rows[-1] = [(Action(c[0].stage, "F", c[0].mb - 1),) if c[0].type == "F" else c for c in last]
    note = (
        f"torch's Schedule1F1B order numbers rank {len(rows) - 1}'s forwards 1..{m}; "
        f"renumbered 0..{m - 1}, which is what its runtime executes"
    )
    return [note]


def torch_order(
    name: str, p: int, m: int, v: int | None
) -> tuple[str, list[list[Cell]], list[str]]:
    """(class name, torch's per-rank actions, notes on what was corrected) for p, m, v."""
    cls_name = class_name(name)
    v = default_chunks(cls_name) if v is None else v
    if p < 1 or m < 1 or v < 1:
        raise PipecError(
            f"--pp, --microbatches and --chunks must be at least 1 (got {p}, {m}, {v})"
        )
    if cls_name in SINGLE_STAGE and v != 1:
        raise PipecError(f"{cls_name} runs one stage per rank; --chunks must be 1 (got {v})")
    from torch.distributed.pipelining import schedules  # deferred: importing torch takes ~1.5 s

    cls = getattr(schedules, cls_name)
    stages = [
        SimpleNamespace(
            num_stages=p * v,
            group_size=p,
            group_rank=0,
            stage_index=i,
            submod=None,
            stage_index_to_group_rank=None,
        )
        for i in range(v)
    ]
    try:
        sched = cls(stages[0], m) if cls_name in SINGLE_STAGE else cls(stages, m)
    except (ValueError, RuntimeError, AssertionError) as e:
        why = str(e).splitlines()[0]
        raise PipecError(f"torch's {cls_name} refuses p={p} m={m} v={v}: {why}") from None
    where = f"torch's {cls_name} order (p={p}, m={m}, v={v})"
    rows = [
        [parse_cell(str(a), f"{where}, rank {r}") for a in sched.pipeline_order[r] if a is not None]
        for r in range(p)
    ]
    notes = _fix_1f1b_last_rank(rows, m) if cls_name == "Schedule1F1B" else []
    return cls_name, rows, notes
