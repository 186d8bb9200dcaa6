"""Keeping the shortest of several V-shape orders, timed under the real costs, within a peak.

A V-placed family can justify more than one order for the same placement and memory: its
paper's construction and that construction's variants (the paper's cool-down, list
scheduling's), the orders peers publish (torch's ZB-V, the zero-bubble repository's V-Min and
V-Half), and greedy orders built under the real costs. Each is timed with the costs the user
gave, with the simulator's semantics (a pass starts when its rank is free and its input has
arrived, plus the transfer time between ranks), and the shortest whose peak is within the
family's bound is kept. Ties keep the earlier candidate, so where the costs cannot tell
them apart the family's own construction is what it emits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate

from pipec.ir import Op
from pipec.passes.costs import CostModel
from pipec.passes.schedules.vblocks import Orders, durations, start_times

_TIE = 1e-12
"""Relative margin under which two makespans count as equal (float sums in another order)."""


def delays(p: int, costs: CostModel) -> list[list[float]]:
    """The time a stage input takes from rank a to rank b (the simulator's message time)."""
    size = costs.mem_input * 0.5  # a V chunk's stash is half a rank's share
    return [[costs.transfer_time(a, b, size) for b in range(p)] for a in range(p)]


def makespan(orders: Orders, costs: CostModel) -> float:
    """When the last pass ends if every pass starts as early as its order and input allow."""
    dur = durations(len(orders), costs)
    starts = start_times(orders, dur, delays(len(orders), costs))
    assert starts is not None, "candidate orders never deadlock"
    return max(s[-1] + dur[r][orders[r][-1]] for r, s in enumerate(starts) if s)


def rank_peaks(orders: Orders, costs: CostModel) -> list[float]:
    """Each rank's peak of live activations in rank shares (the simulator's figure): a
    chunk's stash is half a share; F adds mem_F of it, B frees all but -mem_W, W the rest."""
    delta = {
        k: 0.5 * costs.mem_delta(op, False)
        for k, op in zip("FfBbWw", (Op.F, Op.F, Op.B, Op.B, Op.W, Op.W))
    }
    return [max(accumulate(map(delta.__getitem__, row), initial=0.0)) for row in orders]


def peak(orders: Orders, costs: CostModel) -> float:
    """The largest rank peak, in rank shares."""
    return max(rank_peaks(orders, costs))


def shortest(
    candidates: Iterable[Orders], costs: CostModel, bound: float | Sequence[float] | None = None
) -> Orders | None:
    """The first of the candidates with the smallest makespan under `costs` among those whose
    peak is at most `bound` (rank shares: one figure for every rank, or one per rank; None: no
    bound), or None if none is."""
    best: tuple[float, Orders] | None = None
    for orders in candidates:
        if bound is not None and not _within(rank_peaks(orders, costs), bound):
            continue
        span = makespan(orders, costs)
        if best is None or span < best[0] * (1 - _TIE):
            best = (span, orders)
    return None if best is None else best[1]


def _within(peaks: list[float], bound: float | Sequence[float]) -> bool:
    tops = bound if isinstance(bound, Sequence) else [bound] * len(peaks)
    return all(x <= top + 1e-9 for x, top in zip(peaks, tops))
