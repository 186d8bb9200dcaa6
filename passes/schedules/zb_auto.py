"""ZB-auto: the zero-bubble paper's heuristic scheduler for real costs and a memory cap.

Qi et al. (ICLR 2024), section 3.1: warm up each stage with as many forwards as the cap allows
(and as fill the time until its first backward can start), alternate F and B in the steady
state, and fill a wait with W when W fits in it (or when leaving the gap would raise the
largest bubble any stage has so far, or when memory is at the cap). Three boolean policies
change the details; every combination is tried and the shortest longest-span kept. Where the
handcrafted ZB-H1 (p stashes) or ZB-H2 (2p-1) fits under the cap, it is timed beside it under
the real costs and kept if shorter (torch's ZB-1P at one stage per rank is ZB-H1).
`--memory-limit p` (stashes) is ZB-1P, `2p` is ZB-2P; the default is ZB-1P.

Memory is in the cost model's units: F adds mem_F, B adds -(mem_F+mem_W), W adds mem_W, so a
micro-batch nets zero; with sequential stages a stage's stash share is 1, so the cap is in
the same units as `--mem` (stashes by default).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pipec.ir import Instr, Layout, Op, PipecError, Schedule, single_pipeline
from pipec.passes.costs import CostModel
from pipec.passes.mapping import sequential, stage_ranks
from pipec.passes.registry import Request, only_v, schedule
from pipec.passes.schedules.limits import peak_of
from pipec.passes.schedules.zero_bubble import zb_h1_order, zb_h2_order
from pipec.passes.simulate import play

_EPS = 1e-9
_PASSES = (Op.F, Op.B, Op.W)


@dataclass(frozen=True)
class Policy:
    """The heuristic's three switches (all eight combinations are tried)."""

    allow_bubble_before_first_b: bool
    """Warm up while the next F still ends before the first B can start (else: starts)."""
    prioritize_b: bool
    """Hold back a stage's F when it is 2+ forwards ahead of the next stage and the F would
    delay the B that stage is about to send back."""
    no_bubble_greedy: bool
    """Fill a wait shorter than T_W with a W even when leaving it would not raise the
    largest bubble."""


@dataclass
class _Greedy:
    """The state of one run of the heuristic: per-stage counters, clocks and memory."""

    p: int
    m: int
    costs: CostModel
    cap: float
    count: dict[Op, list[int]] = field(default_factory=dict)
    end: list[float] = field(default_factory=list)
    mem: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    done: dict[tuple[Op, int, int], float] = field(default_factory=dict)
    orders: list[list[Instr]] = field(default_factory=list)
    durations: dict[Op, list[float]] = field(default_factory=dict)
    deltas: dict[Op, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.count = {k: [0] * self.p for k in _PASSES}
        self.end, self.mem, self.bubble = [0.0] * self.p, [0.0] * self.p, [0.0] * self.p
        self.orders = [[] for _ in range(self.p)]
        self.durations = {
            k: [self.costs.per_chunk(k.value, s) for s in range(self.p)] for k in _PASSES
        }
        self.deltas = {k: self.costs.mem_delta(k, recompute=False) for k in _PASSES}

    def cost(self, kind: Op, stage: int) -> float:
        return self.durations[kind][stage]

    def mem_of(self, kind: Op) -> float:
        return self.deltas[kind]

    def fits(self, stage: int, kind: Op, extra: float = 0.0) -> bool:
        return self.mem[stage] + extra + self.mem_of(kind) <= self.cap + _EPS

    def put(self, stage: int, kind: Op) -> None:
        """Append the stage's next pass of `kind`, starting as early as its input allows."""
        mb = self.count[kind][stage]
        assert mb < self.m and self.fits(stage, kind)
        cost = self.cost(kind, stage)
        finish = no_wait = self.end[stage] + cost
        dep = self.arrival(stage, kind, mb)
        if dep is not None:
            finish = max(finish, dep + cost)
        if self.count[Op.F][stage] > 0:
            self.bubble[stage] += finish - no_wait
        self.end[stage] = finish
        self.done[(kind, stage, mb)] = finish
        self.mem[stage] += self.mem_of(kind)
        self.orders[stage].append(Instr(kind, stage, mb))
        self.count[kind][stage] += 1

    def arrival(self, stage: int, kind: Op, mb: int) -> float | None:
        """When the cross-stage input of (kind, stage, mb) arrives; None if it has none."""
        if kind is Op.F and stage > 0:
            return self.done[(Op.F, stage - 1, mb)] + self.costs.comm
        if kind is Op.B and stage < self.p - 1:
            return self.done[(Op.B, stage + 1, mb)] + self.costs.comm
        return None

    def pending_w(self, stage: int) -> bool:
        return self.count[Op.W][stage] < self.count[Op.B][stage]

    def make_room(self, stage: int, kind: Op) -> None:
        """Run W's until `kind` fits under the cap (the cap forces them, gaps or not)."""
        while not self.fits(stage, kind):
            if not self.pending_w(stage):
                raise _NoRoom
            self.put(stage, Op.W)

    def fill_wait(self, stage: int, arrive: float, greedy: bool) -> None:
        """Before a pass whose input arrives at `arrive`: W's that fit in the wait, then one
        more if the wait is longer than the largest bubble allows (or `greedy` says so)."""
        while self.pending_w(stage) and self.end[stage] + self.cost(Op.W, stage) <= arrive:
            self.put(stage, Op.W)
        if (
            self.pending_w(stage)
            and self.end[stage] < arrive
            and (greedy or arrive - self.end[stage] > max(self.bubble) - self.bubble[stage])
        ):
            self.put(stage, Op.W)

    def span(self) -> float:
        """The longest stage span (first F start to last W end): the papers' iteration time."""
        return max(
            self.done[(Op.W, s, self.m - 1)] - self.done[(Op.F, s, 0)] + self.cost(Op.F, s)
            for s in range(self.p)
        )


class _NoRoom(Exception):
    """The cap leaves no room for the next pass and no W is left to free memory."""


def _warmup(g: _Greedy, policy: Policy) -> None:
    """Micro-batch 0: F everywhere, then per stage the extra forwards that fit in memory and
    in the time until its first B can start, then the first B from the last stage back."""
    p, m, comm = g.p, g.m, g.costs.comm
    for s in range(p):
        g.put(s, Op.F)
    extra = [0] * p
    first_b = g.done[(Op.F, p - 1, 0)] + g.cost(Op.B, p - 1)
    for s in range(p - 2, -1, -1):
        mem, clock = g.mem[s], g.end[s]
        while g.count[Op.F][s] + extra[s] < m and mem + g.mem_of(Op.F) <= g.cap + _EPS:
            if policy.allow_bubble_before_first_b:
                if clock + g.cost(Op.F, s) > first_b + comm:
                    break
            elif clock >= first_b + comm:
                break
            mem += g.mem_of(Op.F)
            clock += g.cost(Op.F, s)
            extra[s] += 1
        first_b = max(clock, first_b + comm) + g.cost(Op.B, s)
    for s in range(1, p):
        # A stage never runs a forward its predecessor has not (uneven costs can let a later
        # stage fit more in its window), and stays strictly fewer ahead unless both run all m.
        extra[s] = min(extra[s], extra[s - 1])
        while extra[s] > 0 and extra[s] >= extra[s - 1] and g.count[Op.F][s] + extra[s] < m:
            extra[s] -= 1
    for s in range(p):
        for _ in range(extra[s]):
            g.put(s, Op.F)
    for s in range(p - 1, -1, -1):
        g.put(s, Op.B)


def _wants_forward(g: _Greedy, s: int, policy: Policy) -> bool:
    """Whether stage s runs its next F in this round (prioritize_b may hold it back)."""
    if g.count[Op.F][s] >= g.m:
        return False
    nxt = s + 1
    if not (policy.prioritize_b and nxt < g.p and g.count[Op.F][s] >= g.count[Op.F][nxt] + 2):
        return True
    # When stage s+1 will send its next B back (after its next F and that B).
    b_back = g.end[nxt] + g.cost(Op.F, nxt) + g.cost(Op.B, nxt) + g.costs.comm
    if g.end[s] >= b_back:
        return False
    w_cost, extra, n_w = 0.0, g.mem_of(Op.F), 0
    while g.mem[s] + extra > g.cap + _EPS and g.count[Op.W][s] + n_w < g.count[Op.B][s]:
        w_cost += g.cost(Op.W, s)
        extra += g.mem_of(Op.W)
        n_w += 1
    if g.end[s] + g.cost(Op.F, s) + w_cost <= b_back:
        return True
    return b_back - g.end[s] > max(g.bubble) - g.bubble[s]


def _run(p: int, m: int, costs: CostModel, cap: float, policy: Policy) -> _Greedy:
    g = _Greedy(p, m, costs, cap)
    _warmup(g, policy)
    for i in range(1, m):
        wants = [_wants_forward(g, s, policy) for s in range(p)]
        for s in range(p - 2, -1, -1):
            wants[s] = wants[s] and wants[s + 1]  # a stage runs F only if the next one does
        for s in range(p):
            if wants[s]:
                g.make_room(s, Op.F)
                if s > 0:
                    arrive = g.done[(Op.F, s - 1, g.count[Op.F][s])] + costs.comm
                    g.fill_wait(s, arrive, policy.no_bubble_greedy)
                g.put(s, Op.F)
        for s in range(p - 1, -1, -1):
            g.make_room(s, Op.B)
            if s + 1 < p:
                g.fill_wait(s, g.done[(Op.B, s + 1, i)] + costs.comm, policy.no_bubble_greedy)
            if s == 0 and g.count[Op.F][s] == m:
                while g.pending_w(s):
                    g.put(s, Op.W)
            g.put(s, Op.B)
    for s in range(p):
        while g.count[Op.W][s] < m:
            g.put(s, Op.W)
    return g


def zb_auto_orders(
    p: int, m: int, costs: CostModel, cap: float, layout: Layout
) -> list[list[Instr]]:
    """The best of the eight policies (the shortest longest span, as the reference keeps),
    or ZB-H1 or ZB-H2 where they fit under the cap and are shorter under the costs, on
    `layout` (p ranks, one stage each)."""
    best: _Greedy | None = None
    for flags in itertools.product((True, False), repeat=3):
        try:
            g = _run(p, m, costs, cap, Policy(*flags))
        except _NoRoom:
            continue
        if best is None or g.span() < best.span():
            best = g
    if best is None:
        raise PipecError(f"zb-auto: no schedule fits under --memory-limit {cap:g}")
    orders, finish = best.orders, max(best.end)
    for build in (zb_h1_order, zb_h2_order):
        fixed = [build(p, m, r) for r in range(p)]
        if peak_of(fixed, layout, costs) > cap + _EPS:
            continue
        played = play(layout, fixed, costs).times
        end = max(t for _, t in played.values())
        if end < finish * (1 - 1e-12):  # ties keep the heuristic's order
            orders, finish = fixed, end
    return orders


def _check(req: Request) -> str | None:
    c = req.costs
    for kind in ("F", "B", "W"):
        if min(getattr(c, kind)) <= 0:
            least = min(getattr(c, kind))
            return f"--costs {kind} must be positive (got {least:g}); every pass takes time"
    if req.memory_limit is not None and req.memory_limit < c.mem_F - _EPS:
        return (
            f"--memory-limit {req.memory_limit:g} is below the smallest feasible, {c.mem_F:g} "
            "(one micro-batch's stash); use at least that"
        )
    return None


@schedule(
    "zb-auto",
    "zero bubble heuristic for real costs under --memory-limit (default p: ZB-1P; 2p: ZB-2P)",
    checks=(only_v(1), _check),
)
def zb_auto(req: Request) -> Schedule:
    cap = req.p * req.costs.mem_F if req.memory_limit is None else req.memory_limit
    layout = single_pipeline(req.p, req.m, stage_ranks(sequential, req.p, req.p))
    orders = zb_auto_orders(req.p, req.m, req.costs, cap, layout)
    return Schedule("zb-auto", req.p, req.m, 1, layout, tuple(map(tuple, orders)))
