"""Chimera (Li and Hoefler, SC'21): two 1F1B-like pipelines in opposite directions.

Rank r holds stage r of the down pipeline and stage p-1-r of the up pipeline (a replica of
chunk p-1-r); half the micro-batches flow each way, and each replica pair's gradients are
all-reduced at the end. The basic scheduling unit has p micro-batches (p/2 each way); in
slots of one forward or one backward, micro-batch j (0-based within its unit and direction)
runs its forward at position k in slot

    f(j, k) = k + j          while k < c = ceil(p/4): before the two directions meet,
    f(j, k) = k + 2j         after: the directions share the middle ranks, one slot each,

and its backward at position k in slot p + 2j + (p-1-k). On rank r the slots of position r
and p-1-r never collide, so a unit takes 3p-2 slots with (p/2-1)·2 of them idle per rank:
the paper's bubble ratio (D-2)/(2N+D-2). Further units are concatenated: list scheduling by
(unit, slot) lets their forwards fill the gaps the previous unit leaves, which keeps the
ratio at (D-2)/(2N+D-2) for N a multiple of D (with equal forward and backward slots).
"""

from __future__ import annotations

from pipec.ir import Op, Schedule
from pipec.passes.registry import Request, only_v, schedule
from pipec.passes.replicas import syncs_at_end
from pipec.passes.schedules.bidirectional import even_p, two_way_layout
from pipec.passes.schedules.slots import Node, list_schedule


def _check(req: Request) -> str | None:
    if req.m % 2:
        return f"--microbatches {req.m} must be even (half flow each way); try {req.m + 1}"
    return None


@schedule(
    "chimera",
    "Chimera: down and up pipelines over the same ranks (2x weights), m/2 micro-batches each "
    "way, replica gradients all-reduced at the end; even p and m",
    checks=(only_v(1), even_p, _check),
)
def chimera(req: Request) -> Schedule:
    p, m = req.p, req.m
    layout = two_way_layout(p, m, tuple(range(p)))
    half, c = p // 2, (p // 2 + 1) // 2

    def slot(node: Node) -> tuple[int, int]:
        op, s, mb = node
        k = s % p  # position in its pipeline
        unit, j = divmod(mb % (m // 2), half)
        if op is Op.F:
            return unit, k + j if k < c else k + 2 * j
        return unit, p + 2 * j + (p - 1 - k)

    orders = list_schedule(layout, slot, lambda node: 1)
    return Schedule("chimera", p, m, 1, layout, syncs_at_end(layout, orders))
