"""ZB-V: the zero-bubble paper's V-shape schedule (Qi et al., ICLR 2024, section 6).

2p chunks, rank r holding stages r and 2p-1-r, at 1F1B's memory (p stashes, 2p chunk
stashes). The reference builds it greedily under real costs, round by round: a warm-up that
fills each rank with chunk-0 forwards until the first chunk-1 forward can arrive, then rounds
of one input-gradient backward (B or b) and one forward (F or f) per rank, weight passes
filling the waits (and forced when memory is at the cap). Two switches (whether a wait before
B, and before F or f, may take a W that leaves a bubble) give four runs; each is re-run with
the per-rank bubbles of the last run "approved" while that lowers its largest bubble. The
shortest of the four under the real costs is kept, or torch's fixed ZB-V order (zbv_fixed,
the paper's schedule written out for equal costs) where that is shorter. With equal F, B and
W costs the bubble is zero. Pass names are vblocks':
F f forwards of chunk 0 and 1, B b backwards of chunk 1 and 0, W w their weight passes.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace

from pipec.ir import Op, Schedule
from pipec.passes.costs import CostModel
from pipec.passes.registry import Request
from pipec.passes.schedules.vbest import shortest
from pipec.passes.schedules.vblocks import KINDS, Durations, Orders, durations, waits_for
from pipec.passes.schedules.vshape import v_family, v_schedule
from pipec.passes.schedules.zbv_fixed import zbv_orders

_EPS = 1e-9


class _Stuck(Exception):
    """A greedy run cannot go on: uneven chunk costs pushed it over 1F1B's memory, or to a
    pass whose input is not placed yet."""


@dataclass
class _Greedy:
    """One run: per-rank clocks, counters, memory, bubbles and pending weight passes."""

    p: int
    m: int
    costs: CostModel
    approved: list[float] | None
    fill_b: bool
    fill_f: bool
    ends: dict[tuple[int, str, int], float] = field(default_factory=dict)
    clock: list[float] = field(default_factory=list)
    mem: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    count: list[dict[str, int]] = field(default_factory=list)
    pending: list[deque[str]] = field(default_factory=list)
    orders: Orders = field(default_factory=list)
    dur: Durations = field(default_factory=list)
    delta: dict[str, float] = field(default_factory=dict)
    cap: float = 0.0

    def __post_init__(self) -> None:
        p = self.p
        self.clock, self.mem, self.bubble = [0.0] * p, [0.0] * p, [0.0] * p
        self.count = [dict.fromkeys(KINDS, 0) for _ in range(p)]
        self.pending = [deque() for _ in range(p)]
        self.orders = [[] for _ in range(p)]
        self.dur = durations(p, self.costs)
        share = 0.5  # a chunk's stash is half a rank's share
        self.delta = {
            k: share * self.costs.mem_delta(op, False)
            for k, op in zip(KINDS, (Op.F, Op.F, Op.B, Op.B, Op.W, Op.W))
        }
        self.cap = p * self.costs.mem_F

    def largest_bubble(self, rank: int | None = None) -> float:
        """The largest bubble so far; for `rank`, at least what the approved bubbles leave it."""
        top = max(self.bubble)
        if rank is not None and self.approved is not None:
            top = max(top, max(self.approved) - self.approved[rank])
        return top

    def put(self, r: int, kind: str) -> None:
        n = self.count[r][kind]
        assert n < self.m
        if self.mem[r] + self.delta[kind] > self.cap + _EPS:
            raise _Stuck
        cost = self.dur[r][kind]
        finish = no_wait = self.clock[r] + cost
        dep = waits_for(self.p, r, kind)
        if dep is not None:
            done = self.ends.get((dep[0], dep[1], n))
            if done is None:
                raise _Stuck
            if dep[0] != r:
                finish = max(finish, done + self.costs.comm + cost)
        if self.count[r]["F"] > 0:
            self.bubble[r] += finish - no_wait
        self.ends[(r, kind, n)] = self.clock[r] = finish
        self.mem[r] += self.delta[kind]
        self.orders[r].append(kind)
        self.count[r][kind] = n + 1
        if kind in "Bb":
            self.pending[r].append("W" if kind == "B" else "w")

    def put_w(self, r: int) -> None:
        self.put(r, self.pending[r].popleft())

    def arrival(self, r: int, kind: str) -> float | None:
        """When the next `kind` pass's input from another rank arrives (None: none, or local)."""
        dep = waits_for(self.p, r, kind)
        if dep is None or dep[0] == r:
            return None
        done = self.ends.get((dep[0], dep[1], self.count[r][kind]))
        return None if done is None else done + self.costs.comm

    def fill_wait(self, r: int, kind: str, policy: bool) -> None:
        """Before `kind`: W's that fit in its wait, then one more if the wait would exceed
        the largest bubble allowed (always for b, per `policy` otherwise)."""
        arrive = self.arrival(r, kind)
        if arrive is None:
            return
        w_cost = self.dur[r][self.pending[r][0]] if self.pending[r] else 0.0
        while self.pending[r] and arrive >= self.clock[r] + w_cost:
            self.put_w(r)
            w_cost = self.dur[r][self.pending[r][0]] if self.pending[r] else 0.0
        if (
            self.pending[r]
            and arrive - self.clock[r] > self.largest_bubble(r) - self.bubble[r]
            and policy
        ):
            self.put_w(r)

    def make_room(self, r: int, kind: str) -> None:
        while self.mem[r] + self.delta[kind] > self.cap + _EPS:
            self.put_w(r)


def _warmup(g: _Greedy) -> None:
    """F on every rank, then from the last rank down: chunk-0 forwards (on this rank and all
    before it) while they fit in memory and end before the first f arrives, then that f;
    then forwards of both chunks, alternately, until each rank has caught up with the one
    before it."""
    p, m = g.p, g.m
    for r in range(p):
        g.put(r, "F")
    for r in range(p - 1, -1, -1):
        if r < p - 1:
            f_arrives = g.ends[(r + 1, "f", 0)] + g.costs.comm
            while (
                g.mem[r] + g.delta["F"] * (2 + 2 * r) <= g.cap + _EPS
                and g.clock[r] + g.dur[r]["F"] <= f_arrives
                and g.count[0]["F"] < m
            ):
                for q in range(r + 1):
                    g.put(q, "F")
        g.put(r, "f")
    chunk = "F"
    for r in range(1, p):
        while (
            g.count[r]["F"] + g.count[r]["f"] < g.count[r - 1]["F"] + g.count[r - 1]["f"]
            or g.count[r]["f"] <= g.count[r - 1]["f"] < m
        ):
            for q in range(p - 1, r - 1, -1):
                if g.count[q][chunk] < m:
                    g.put(q, chunk)
            chunk = "f" if chunk == "F" else "F"


def _backward_round(g: _Greedy) -> None:
    """One B or b per rank: b when the next rank has sent its input (or chunk 0 is done),
    B otherwise; b's from the last rank down, then B's from rank 0 up."""
    p, m = g.p, g.m
    for r in range(p):
        g.make_room(r, "B")
    up, down = [], []
    for r in range(p):
        c = g.count[r]
        if c["b"] >= c["B"]:
            up.append(r)
        elif r == p - 1 or (r + 1, "b", c["b"]) in g.ends or c["B"] >= m:
            down.append(r)
        else:
            up.append(r)
    for r, kind in [(r, "b") for r in reversed(down)] + [(r, "B") for r in up]:
        g.fill_wait(r, kind, policy=(kind == "b") or g.fill_b)
        g.put(r, kind)


def _forward_round(g: _Greedy) -> None:
    """At most one F or f per rank: f once chunk 0 is ahead and f's input is there."""
    p, m = g.p, g.m
    for r in range(p):
        c = g.count[r]
        if c["f"] >= m:
            continue
        if c["f"] >= c["F"]:
            kind = "F"
        elif r == p - 1 or (r + 1, "f", c["f"]) in g.ends:
            kind = "f"
        elif c["F"] < m and (r == 0 or (r - 1, "F", c["F"]) in g.ends):
            kind = "F"
        else:
            continue
        g.make_room(r, kind)
        g.fill_wait(r, kind, policy=g.fill_f)
        g.put(r, kind)


def _run(
    p: int, m: int, costs: CostModel, fill_b: bool, fill_f: bool, approved: list[float] | None
) -> _Greedy:
    g = _Greedy(p, m, costs, approved, fill_b, fill_f)
    _warmup(g)
    for _ in range(2 * m):
        _backward_round(g)
        _forward_round(g)
    for r in range(p):
        while g.pending[r]:
            g.put_w(r)
    return g


REFINE_ROUNDS = 16
"""At most this many re-runs with approved bubbles (the reference has no cap)."""


def _refined(p: int, m: int, costs: CostModel, fill_b: bool, fill_f: bool) -> _Greedy:
    """Re-run with the last run's bubbles approved while that lowers the largest bubble."""
    best = _run(p, m, costs, fill_b, fill_f, None)
    for _ in range(REFINE_ROUNDS):
        again = _run(p, m, costs, fill_b, fill_f, list(best.bubble))
        if again.largest_bubble() >= best.largest_bubble():
            break
        best = again
    return best


def zb_v_orders(p: int, m: int, costs: CostModel) -> Orders:
    """The shortest under the costs of the four policy runs and torch's fixed ZB-V order,
    all within 1F1B's memory (runs that tie keep the reference's pick: the smallest bubble).

    With uneven per-chunk costs a greedy run can get stuck (more forwards than p stashes hold,
    or a pass before its input); when every run does, the runs are built for the chunks' mean
    costs instead (an order is valid under any costs; it is timed under the real ones), and
    where those get stuck too torch's order is what remains.
    """
    runs = sorted(_runs(p, m, costs), key=lambda g: g.largest_bubble())
    best = shortest([*(g.orders for g in runs), zbv_orders(p, m)], costs, p * costs.mem_F)
    assert best is not None  # the runs keep 1F1B's memory
    return best


def _runs(p: int, m: int, costs: CostModel) -> list[_Greedy]:
    """The refined runs of the four policies that do not get stuck (see zb_v_orders)."""
    runs = []
    for fill_b, fill_f in itertools.product((True, False), repeat=2):
        try:
            runs.append(_refined(p, m, costs, fill_b, fill_f))
        except _Stuck:
            continue
    if not runs and max(len(costs.F), len(costs.B), len(costs.W)) > 1:
        mean = replace(
            costs,
            F=(sum(costs.F) / len(costs.F),),
            B=(sum(costs.B) / len(costs.B),),
            W=(sum(costs.W) / len(costs.W),),
        )
        return _runs(p, m, mean)
    return runs


@v_family(
    "zb-v",
    "zero bubble V: 2 chunks per rank in a V, greedy under real costs at 1F1B's memory (p stashes)",
)
def zb_v(req: Request) -> Schedule:
    return v_schedule("zb-v", req, zb_v_orders(req.p, req.m, req.costs))
