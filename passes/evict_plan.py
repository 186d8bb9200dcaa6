"""BPipe's mechanism for one evictor/acceptor pair: plan the evictions, place both halves.

`passes/evict.py` is the pass; this file holds what it does per pair. A rank's program is seen
as its compute ops and the gaps between them (`RankView`): memory changes only at compute
ops, times come from one simulation, and a new message may go after any of a gap's messages.

Evictor, Belady with prefetch (`plan_evictor`): walk its compute ops; before an op that would
take memory over the limit (an F, or a LOAD that is due), evict the resident stash whose use is
furthest away, and only as many as needed. Under 1F1B that is the most recent forward, as in
BPipe. Each EVICT goes early enough that the stash has left (the lead: one transfer time)
before its memory is needed, where that is after its F; each LOAD at the latest point a lead
before the stash's use starts, so the backward does not wait when the link is fast enough;
where memory does not allow the LOAD there, it moves later.

Acceptor (`place_on_acceptor`): each ACCEPT/RETURN goes to the latest point the acceptor
reaches no later than its half on the evictor, so the transfer starts when the evictor issues
it; earlier where the acceptor's own limit needs it, later only when nothing earlier fits; and
always where the happens-before test of `passes/rendezvous.py` allows it.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from pipec.ir import COMPUTE_OPS, Instr, Op, PipecError, Program
from pipec.passes.rendezvous import MESSAGE_OPS

EPS = 1e-9
_READS = (Op.RECOMPUTE, Op.B, Op.BW)
Stash = tuple[int, int]
Move = tuple[int, int, int, str, Stash]
"""(gap on the evictor, phase, sequence number, kind, stash); in a gap, phase 0 evicts make
room for phase 1 loads, and phase 2 evicts leave early for a later gap's needs."""


class Infeasible(PipecError):
    """The limit cannot be met by eviction; the message says where it fails."""


@dataclass(frozen=True)
class RankView:
    """One rank's program as the pass sees it: compute ops and the gaps between them.

    Gap g is every point after compute op g-1 and before compute op g (gap n: after the last).
    Memory changes only at compute ops, so it is one level per gap; a new message goes after
    one of the gap's messages (or at its start), as the happens-before test allows.
    """

    rank: int
    prog: Program
    comp: list[int]  # program positions of compute ops
    start: list[float]  # per compute op
    clock: list[float]  # per gap: when the rank gets there
    level: list[float]  # per gap: live memory there, nothing evicted
    msgs: list[int]  # program positions of messages
    first: list[int]  # per gap: how many messages come before it
    last: list[int]  # per gap: how many messages come before its end
    fwd: dict[int, Stash]  # compute index of an F -> its stash
    use: dict[Stash, int]  # stash -> compute index of its first read
    table: list[list[float]]  # sparse table over `level` for range maxima

    @property
    def peak(self) -> float:
        return max(self.level)

    def segmax(self, i: int, j: int) -> float:
        """Largest level over gaps i..j (inclusive); -inf when empty."""
        if i > j:
            return float("-inf")
        k = (j - i + 1).bit_length() - 1
        return max(self.table[k][i], self.table[k][j - (1 << k) + 1])


def view(r: int, prog: Program, times: dict, profile: list[float]) -> RankView:
    """Rank r's program seen as gaps, with one simulation's `times` and its memory profile."""
    comp = [j for j, i in enumerate(prog) if i.op in COMPUTE_OPS]
    span = [times[(prog[j].op, prog[j].stage, prog[j].mb)] for j in comp]
    clock = [0.0] + [end for _, end in span]
    level = [0.0] + [profile[j] for j in comp]
    msgs = [j for j, i in enumerate(prog) if i.op in MESSAGE_OPS]
    bounds = [0] + [j + 1 for j in comp] + [len(prog)]  # gap g spans bounds[g]..bounds[g+1]-1
    first = [bisect.bisect_left(msgs, b) for b in bounds[:-1]]
    last = [bisect.bisect_left(msgs, b) for b in bounds[1:]]
    fwd, use = {}, {}
    for g, j in enumerate(comp):
        i = prog[j]
        if i.op is Op.F:
            fwd[g] = (i.stage, i.mb)
        elif i.op in _READS:
            use.setdefault((i.stage, i.mb), g)
    table = [level]
    while 2 ** len(table) <= len(level):
        prev, w = table[-1], 1 << (len(table) - 1)
        table.append([max(prev[i], prev[i + w]) for i in range(len(prev) - w)])
    start = [begin for begin, _ in span]
    return RankView(r, prog, comp, start, clock, level, msgs, first, last, fwd, use, table)


def plan_evictor(e: RankView, limit: float, size: Sequence[float], tau: float) -> list[Move]:
    """Belady with prefetch on one evicting rank, `tau` the lead, `size[stage]` the memory one
    of the stage's stashes holds (the measure of `limit`); raises Infeasible."""
    n = len(e.comp)
    out: list[Move] = []
    heap: list[tuple[int, int, Stash]] = []  # resident evictable stashes, furthest use first
    loads_at: dict[int, list[Stash]] = {}
    off = 0.0  # memory evicted now
    for g in range(n):
        due = loads_at.pop(g, [])
        rise = max(e.level[g + 1] - e.level[g], 0.0)
        while (need := e.level[g] - off + sum(size[x[0]] for x in due) + rise) > limit + EPS:
            while heap and -heap[0][0] <= g:  # used already
                heapq.heappop(heap)
            if heap:
                neg_u, neg_f, x = heapq.heappop(heap)
                u, f = -neg_u, -neg_f
                # Leave before the memory is needed; come back before the use starts.
                ev = min(g, max(f + 1, bisect.bisect_right(e.clock, e.start[g] - tau + EPS) - 1))
                back = bisect.bisect_right(e.clock, e.start[u] - tau + EPS) - 1
                loads_at.setdefault(min(u, max(g + 1, back)), []).append(x)
                off += size[x[0]]
                # Hoisted to an earlier gap it is not needed for that gap's loads: after them,
                # so that the acceptor does not hold both at once.
                out.append((ev, 0 if ev == g else 2, len(out), "evict", x))
                continue
            later = [x for x in due if e.use[x] > g]
            if not later:
                raise Infeasible(
                    f"rank {e.rank} needs {need:g} at {e.prog[e.comp[g]]} "
                    "with nothing left to evict"
                )
            x = max(later, key=e.use.__getitem__)  # load it one op later instead
            due.remove(x)
            loads_at.setdefault(g + 1, []).append(x)
        for x in due:
            off -= size[x[0]]
            out.append((g, 1, len(out), "load", x))
        x = e.fwd.get(g)
        if x is not None and x in e.use:
            heapq.heappush(heap, (-e.use[x], -g, x))
    out.sort()
    return out


def _fit(
    e: RankView,
    gap_e: int,
    a: RankView,
    ga: int,
    after: tuple[int, int],
    knows: tuple[list[int], list[int]],
) -> tuple[int, int] | None:
    """Message counts (j on e, i on a) to put a new e-a message after, within the two gaps
    and not before `after`, that pass the happens-before test; None if there are none."""
    knows_a, knows_e = knows
    i_lo, i_hi = max(a.first[ga], after[1]), a.last[ga]
    for j in range(max(e.first[gap_e], after[0]), e.last[gap_e] + 1):
        i = max(i_lo, knows_a[j])
        if i <= i_hi and knows_e[i] <= j:
            return j, i
    return None


def place_on_acceptor(
    e: RankView,
    a: RankView,
    moves: Sequence[Move],
    limit: float,
    size: Sequence[float],
    knows: tuple[list[int], list[int]],
) -> list[tuple[int, int, int]]:
    """Per move: the acceptor's gap and the message counts (j on e, i on a) to put the pair
    after (`size` as for `plan_evictor`); raises Infeasible."""
    out: list[tuple[int, int, int]] = []
    prev_gap, after, held = 0, (0, 0), 0.0
    last = len(a.clock) - 1
    for gap_e, _, _, kind, x in moves:
        now = held + (size[x[0]] if kind == "evict" else -size[x[0]])
        pref = max(prev_gap, bisect.bisect_right(a.clock, e.clock[gap_e] + EPS) - 1)
        spot = None
        for ga in chain(range(pref, prev_gap - 1, -1), range(pref + 1, last + 1)):
            if a.segmax(prev_gap + 1, ga) + held > limit + EPS:
                if ga > pref:
                    break  # later gaps only hold the previous stashes longer
                continue
            if a.level[ga] + now <= limit + EPS:
                spot = _fit(e, gap_e, a, ga, after, knows)
                if spot is not None:
                    break
        if spot is None:
            what = "accept" if kind == "evict" else "return"
            raise Infeasible(
                f"rank {a.rank} cannot {what} s={x[0]} mb={x[1]} of rank {e.rank} within the limit"
            )
        out.append((ga, *spot))
        prev_gap, after, held = ga, spot, now
    return out


def insert(rk: RankView, new: Sequence[tuple[int, int, Instr]]) -> Program:
    """Put each new instruction (gap, message count, instr) in its gap, right after that many
    of the rank's messages; new ones at one spot keep their order."""
    at: dict[int, list[Instr]] = {}
    for g, count, instr in new:
        gap_start = rk.comp[g - 1] + 1 if g else 0
        spot = max(gap_start, rk.msgs[count - 1] + 1 if count else 0)
        at.setdefault(spot, []).append(instr)
    out: list[Instr] = []
    for j in range(len(rk.prog) + 1):
        out.extend(at.get(j, ()))
        if j < len(rk.prog):
            out.append(rk.prog[j])
    return tuple(out)
