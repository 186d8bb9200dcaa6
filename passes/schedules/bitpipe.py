"""BitPipe (Wu, Chen and Yu, 2024): Chimera's two directions, each replica a V of 2p chunks.

Each model replica is cut into 2p chunks laid out as a V: the down replica puts chunk k on
rank `v_shape(k)`, so rank r holds chunks r and 2p-1-r; the up replica is the mirror (chunks
p-1-r and p+r on rank r).
Every rank holds four chunks, the V's turning point is a hand-off on one rank (no send), and
each chunk's replica all-reduce is issued right after that chunk's last backward (eager
synchronisation: it overlaps the remaining compute).

Order: as for Chimera, list scheduling in slots (a forward 1, a fused backward 2: B = 2F)
by (unit, slot), a unit being p micro-batches (p/2 each way). Within a unit, micro-batch j of
either direction has its forward at V-position k in slot 2j + k (successive micro-batches two
slots apart: the other direction's forward takes the slot between) and its backward at
V-position k in slot 2p + 2(2p-1-k) + 4j: micro-batch 0 runs straight down the V and straight
back up, later ones follow four slots apart (two backwards, one per direction). At p=4, m=4
this reproduces the paper's figure: every rank busy 24 of 28 units. Later units fill the gaps
of earlier ones, which warms rank r up with 2p+min(r,p-1-r) chunk forwards where the paper's
own order warms up p/2 fewer.
"""

from __future__ import annotations

from pipec.ir import Op, Schedule
from pipec.passes.mapping import v_shape
from pipec.passes.registry import Request, only_v, schedule
from pipec.passes.replicas import eager_syncs
from pipec.passes.schedules.bidirectional import even_p, two_way_layout
from pipec.passes.schedules.slots import Node, list_schedule


def _check(req: Request) -> str | None:
    if req.m % req.p:
        return (
            f"--microbatches {req.m} must be a multiple of --pp {req.p} (units of p/2 "
            f"micro-batches each way); try {req.m + (-req.m) % req.p}"
        )
    return None


@schedule(
    "bitpipe",
    "BitPipe: Chimera's two directions, each replica a V of 2p chunks (4 per rank); eager "
    "replica all-reduce; even p, m a multiple of p",
    default_v=2,
    chunks="2",
    checks=(only_v(2), even_p, _check),
)
def bitpipe(req: Request) -> Schedule:
    p, m = req.p, req.m
    n = 2 * p  # chunks per replica
    layout = two_way_layout(p, m, tuple(v_shape(k, n, p) for k in range(n)))

    def slot(node: Node) -> tuple[int, int]:
        op, s, mb = node
        k = s % n  # V-position in its pipeline
        unit, j = divmod(mb % (m // 2), p // 2)
        if op is Op.F:
            return unit, 2 * j + k
        return unit, n + 2 * (n - 1 - k) + 4 * j

    orders = list_schedule(layout, slot, lambda node: 1 if node[0] is Op.F else 2)
    return Schedule("bitpipe", p, m, 2, layout, eager_syncs(layout, orders))
