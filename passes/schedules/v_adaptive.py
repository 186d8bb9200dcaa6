"""V-Adaptive: search V-shape building blocks for the shortest schedule under a memory limit.

Qi et al. (NeurIPS 2024), section 3.3 and appendix A. A block is given by rank 0's slots
modulo 6 (F at 0; f, B, b at distinct slots 1..5) and the offsets between consecutive ranks,
[δF⁰, δF¹, δB¹, δB⁰] = [k, -1, k, -1]: k0 for the first len0 rank transitions, k1 <= k0 for
the rest. Blocks whose passes collide modulo 6 are dropped. A block's memory is its stable
phase's peak (the lifespan rule); the larger it may be, the smaller the bubble, so the search
starts from the top memory level that fits under the limit.

The paper's search builds and times every candidate: 928 distinct blocks at p = 16, tens of
milliseconds each (the reference code takes 40 s of CPU time at p = 16, m = 64). The search here
is capped. The reference's winner sits at the top memory level that fits (so it does at every
point of its published figures), so only that level is visited: each of its blocks is built
once, cheaply, the way the reference builds it (its cool-down only; every rank may use the
largest rank's peak), at min(m, 2p) micro-batches, stopping early at a schedule without
bubbles. The FINALISTS with the shortest longest span are rebuilt for the real m with every
variant (each rank within its own peak, or within the largest) and timed under the real costs
together with the peers' V orders that fit under the limit (vshape.peer_orders); the shortest
makespan wins (vbest). Under costs far from the unit ones this can miss a block an exhaustive
search would find.
"""

from __future__ import annotations

import itertools
from functools import cache

from pipec.ir import PipecError, Schedule
from pipec.passes.costs import CostModel
from pipec.passes.registry import Request
from pipec.passes.schedules.vbest import shortest
from pipec.passes.schedules.vblocks import (
    Block,
    Durations,
    Orders,
    T,
    block_from_residues,
    durations,
    peak,
    start_times,
)
from pipec.passes.schedules.vreorder import build, every_variant, variants
from pipec.passes.schedules.vshape import peer_orders, v_family, v_schedule

FINALISTS = 3
"""How many of the best trial schedules are rebuilt for the real m with every variant."""


def _residues(
    pattern: tuple[int, ...], k0: int, k1: int, len0: int, p: int
) -> list[list[int]] | None:
    rows = [list(pattern)]
    for i in range(p - 1):
        k = k0 if i < len0 else k1
        row = [(x + d) % T for x, d in zip(rows[-1], (k, -1, k, -1))]
        if len(set(row)) < 4:
            return None
        rows.append(row)
    return rows


def steady_peak(block: Block) -> int:
    """The stable phase's peak in chunk stashes: over one period, the most micro-batches
    whose stage is between its F (or f) and its w (or W), summed over the rank's two stages."""
    late = max(max(slots) for slots in block)  # from here on every period looks the same
    return max(
        sum((t - start) // T - (t - end) // T for start, end in ((F, w), (f, W)))
        for F, f, _, _, W, w in block
        for t in range(late, late + T)
    )


@cache
def blocks_by_level(p: int) -> dict[int, tuple[tuple[tuple[int, ...], ...], ...]]:
    """Every distinct collision-free block for p ranks, grouped by its stable-phase peak."""
    seen: dict[tuple[tuple[int, ...], ...], None] = {}
    for f1, b1, b0 in itertools.permutations(range(1, T), 3):
        for k0 in range(1, T):
            for k1 in range(1, k0 + 1):
                for len0 in range(1, max(p, 2)):
                    residues = _residues((0, f1, b1, b0), k0, k1, len0, p)
                    block = residues and block_from_residues(p, residues)
                    if block:
                        seen[tuple(map(tuple, block))] = None
    levels: dict[int, list] = {}
    for block in seen:
        levels.setdefault(steady_peak([list(s) for s in block]), []).append(block)
    return {level: tuple(found) for level, found in sorted(levels.items())}


def longest_span(orders: Orders, dur: Durations, comm: float) -> float:
    """The longest rank span (first start to last end) when the orders run under `dur`."""
    starts = start_times(orders, dur, comm)
    assert starts is not None
    return max(s[-1] + dur[r][orders[r][-1]] - s[0] for r, s in enumerate(starts))


def _trials(
    p: int, m: int, dur: Durations, comm: float, blocks: tuple
) -> list[tuple[float, tuple]]:
    """(longest span, block) of each block's quick build at m micro-batches (the reference's
    construction); stops at a schedule without bubbles (nothing can beat it)."""
    floor = m * max(sum(d.values()) for d in dur)  # the busiest rank's work
    out = []
    for block in blocks:
        for orders in variants([list(s) for s in block], m, thorough=False, shared=True):
            span = longest_span(orders, dur, comm)
            out.append((span, block))
            if span <= floor + 1e-9:
                return out
    return out


def search(p: int, m: int, costs: CostModel, limit: float) -> Orders:
    """The shortest orders found with a peak of at most `limit` (stashes, or --mem units):
    the finalists' variants, and the peers' orders that fit (see the module docstring)."""
    stash = 0.5 * costs.mem_F  # a chunk's stash: half a rank's share
    levels = blocks_by_level(p)
    fitting = [level for level in levels if level * stash <= limit + 1e-9]
    if not fitting:
        raise PipecError(_infeasible(p, m, limit, stash, levels[min(levels)]))
    top = levels[fitting[-1]]
    shortlist = _trials(p, min(m, 2 * p), durations(p, costs), costs.comm, top)
    finalists = [block for _, block in sorted(shortlist, key=lambda t: t[0])[:FINALISTS]]
    if not finalists:  # no block took the paper's cool-down: every block of the level
        finalists = list(top)
    candidates = [orders for block in finalists for orders in every_variant(list(block), m)]
    best = shortest([*candidates, *peer_orders(p, m)], costs, limit)
    if best is None:
        raise PipecError(_infeasible(p, m, limit, stash, levels[min(levels)]))
    return best


def _infeasible(p: int, m: int, limit: float, stash: float, lowest: tuple) -> str:
    """The one-line refusal, naming the smallest peak a V-shape block reaches here."""
    peaks = [max(map(peak, o)) for b in lowest if (o := build([list(s) for s in b], m))]
    least = min(peaks) * stash
    return (
        f"v-adaptive: --memory-limit {limit:g} is below the smallest feasible at p={p}, m={m}: "
        f"{least:g} (a V-shape block's peak); use at least {least:g}"
    )


@v_family(
    "v-adaptive",
    "V-shape building block searched for the shortest schedule under --memory-limit (default p)",
)
def v_adaptive(req: Request) -> Schedule:
    limit = req.p * req.costs.mem_F if req.memory_limit is None else req.memory_limit
    return v_schedule("v-adaptive", req, search(req.p, req.m, req.costs, limit))
