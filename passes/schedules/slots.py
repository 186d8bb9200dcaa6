"""List scheduling in unit slots: turn a priority per op into each rank's order.

Chimera and BitPipe are published as timetables of equal-length slots. A family gives each
op of its work graph a priority (its slot in the paper's timetable, and which group of
micro-batches it belongs to); here every rank, whenever it is idle, starts the ready op with
the smallest priority, every op lasting its slot count. Where the timetable is feasible
this reproduces it exactly, and ops of later groups fill the gaps the earlier ones leave
(the papers' concatenation of scheduling units). The result is an order, kept whatever the
real costs are.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from pipec.ir import Instr, Layout, Op, dependencies

Node = tuple[Op, int, int]


def fused_nodes(layout: Layout) -> list[Node]:
    """The work graph's nodes when every backward is one fused BW: F and BW per stage and mb."""
    return [
        (k, s, i)
        for pl in layout.pipelines
        for s in pl.stages
        for i in pl.mbs
        for k in (Op.F, Op.BW)
    ]


def list_schedule(
    layout: Layout, priority: Callable[[Node], tuple], slots: Callable[[Node], int]
) -> tuple[tuple[Instr, ...], ...]:
    """Each rank's order of the work graph's F and BW ops under greedy list scheduling."""
    nodes = fused_nodes(layout)
    waiting_on = {n: 0 for n in nodes}
    successors: dict[Node, list[Node]] = {n: [] for n in nodes}
    for n in nodes:
        for dep in dependencies(layout, n):
            waiting_on[n] += 1
            successors[dep].append(n)
    ready: list[list[tuple]] = [[] for _ in range(layout.p)]

    def make_ready(n: Node) -> None:
        # Ties on priority fall back to (stage, mb, op): deterministic, and Op has no order.
        heapq.heappush(ready[layout.stage_rank[n[1]]], (priority(n), n[1], n[2], n[0].value, n))

    for n in nodes:
        if not waiting_on[n]:
            make_ready(n)
    running: list[tuple[int, int, Node]] = []  # (end slot, rank, op)
    idle = set(range(layout.p))
    orders: list[list[Instr]] = [[] for _ in range(layout.p)]
    now = 0
    while True:
        for r in sorted(idle):
            if ready[r]:
                n = heapq.heappop(ready[r])[-1]
                orders[r].append(Instr(*n))
                heapq.heappush(running, (now + slots(n), r, n))
                idle.discard(r)
        if not running:
            break
        now = running[0][0]
        while running and running[0][0] == now:
            _, r, n = heapq.heappop(running)
            idle.add(r)
            for succ in successors[n]:
                waiting_on[succ] -= 1
                if not waiting_on[succ]:
                    make_ready(succ)
    return tuple(tuple(order) for order in orders)
