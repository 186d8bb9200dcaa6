"""BPipe: evict stashes to a partner rank and load them back, so that no rank exceeds a limit.

`insert_evictions(compiled, costs, limit)` takes any lowered program (1F1B, interleaved,
zero-bubble, V-shape: it reads only compute ops, messages, times and memory) and adds
EVICT/LOAD on evicting ranks and ACCEPT/RETURN on their partners. Ranks pair up as BPipe pairs
them (`mapping.mirror_pairs`: the i-th rank in pipeline order with the i-th from the end); in
a pair the rank with the higher peak evicts. What happens in a pair is `passes/evict_plan.py`.

Deadlock freedom: every new message passes the happens-before test of `passes/rendezvous.py`.
Pairs are planned one after the other, each tested against the programs with the previous
pairs' moves in: testing all against the programs as given is not enough, since one pair's
moves can close a cycle through another's (1F1B at p=8 does).
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from functools import cached_property

from passes.costs import CostModel
from passes.evict_plan import (
    EPS,
    Infeasible,
    Move,
    RankView,
    insert,
    place_on_acceptor,
    plan_evictor,
    view,
)
from passes.mapping import mirror_pairs
from passes.rendezvous import events, knowledge
from passes.simulate import activation_profile, play, uses_recompute
from pipec.ir import Compiled, Instr, Op, PipecError

Knowledge = tuple[list[int], list[int]]


class EvictionPlanner:
    """One simulation of the programs, then evictions for any number of memory limits."""

    def __init__(self, compiled: Compiled, costs: CostModel) -> None:
        layout, programs = compiled.layout, compiled.programs
        recompute = uses_recompute(programs)
        times, _ = play(layout, programs, costs)
        self.compiled = compiled
        self.ranks = [
            view(r, prog, times, activation_profile(prog, layout, costs, recompute))
            for r, prog in enumerate(programs)
        ]
        peak = [rk.peak for rk in self.ranks]
        self.pairs = [(a, b) if peak[a] >= peak[b] else (b, a) for a, b in mirror_pairs(layout)]
        self.size = costs.stash_size(recompute) * layout.stash_share
        self.taus = {
            (e, a): max(costs.transfer_time(e, a, self.size), costs.transfer_time(a, e, self.size))
            for e, a in self.pairs
        }
        self._knows: dict[tuple[int, int], Knowledge] = {}
        self._done: dict[float, Compiled] = {}

    @property
    def peak(self) -> float:
        return max(rk.peak for rk in self.ranks)

    @cached_property
    def _events(self) -> list[tuple[int, int]]:
        return events(self.compiled)

    def evict(self, limit: float) -> Compiled:
        """The programs with every rank held to `limit` stashes; an infeasible limit is one
        PipecError naming the smallest feasible one."""
        try:
            return self._apply(limit)
        except Infeasible as e:
            raise PipecError(
                f"--memory-limit {limit:g} is infeasible with --evict ({e}); "
                f"the smallest feasible limit is {self.smallest_feasible():g}"
            ) from None

    def smallest_feasible(self) -> float:
        """The smallest limit eviction meets, searched over the levels a rank can reach (a
        level without eviction, plus or minus whole stashes). The first probe is the balanced
        bound of the fullest pair, half its two peaks (⌈(p+1)/2⌉ under 1F1B); then a binary
        search, where an infeasible probe usually fails fast on the first pair."""
        top = self.peak
        if self.size <= EPS:
            return top
        steps = int(top / self.size + EPS) + 1
        levels = {v for rk in self.ranks for v in rk.level}
        reachable = {round(v + k * self.size, 9) for v in levels for k in range(-steps, steps + 1)}
        candidates = sorted({v for v in reachable if self.size - EPS <= v < top} | {top})
        balanced = (
            max((self.ranks[e].peak + self.ranks[a].peak) / 2 for e, a in self.pairs)
            if self.pairs
            else top
        )
        guess = min(bisect.bisect_left(candidates, balanced - EPS), len(candidates) - 1)
        lo, hi = (
            (0, guess) if self._feasible(candidates[guess]) else (guess + 1, len(candidates) - 1)
        )
        while lo < hi:  # candidates[hi] is feasible: at worst the peak, with no eviction
            mid = (lo + hi) // 2
            if self._feasible(candidates[mid]):
                hi = mid
            else:
                lo = mid + 1
        return candidates[lo]

    def _feasible(self, limit: float) -> bool:
        try:
            self._apply(limit)
        except Infeasible:
            return False
        return True

    def _apply(self, limit: float) -> Compiled:
        key = round(limit, 9)
        if key not in self._done:
            self._done[key] = self._plan(limit)
        return self._done[key]

    def _plan(self, limit: float) -> Compiled:
        paired = {r for pair in self.pairs for r in pair}
        for rk in self.ranks:
            if rk.peak > limit + EPS and rk.rank not in paired:
                raise Infeasible(f"rank {rk.rank} holds {rk.peak:g} stashes and has no partner")
        programs = list(self.compiled.programs)
        changed = False
        for e, a in self.pairs:
            ev, ac = self.ranks[e], self.ranks[a]
            if ev.peak <= limit + EPS:
                continue
            if ac.peak > limit + EPS:
                raise Infeasible(
                    f"rank {a} holds {ac.peak:g} stashes of its own, so it cannot take rank {e}'s"
                )
            if changed:  # test against the programs with the previous pairs' moves in
                now = replace(self.compiled, programs=tuple(programs))
                knows = knowledge(events(now), len(programs), e, a)
            else:
                knows = self._knowledge(e, a)
            moves, placed = self._plan_pair(ev, ac, limit, knows)
            new_e, new_a = [], []
            for (gap_e, _, _, kind, (s, mb)), (gap_a, j, i) in zip(moves, placed):
                ops = (Op.EVICT, Op.ACCEPT) if kind == "evict" else (Op.LOAD, Op.RETURN)
                new_e.append((gap_e, j, Instr(ops[0], s, mb, a)))
                new_a.append((gap_a, i, Instr(ops[1], s, mb, e)))
            programs[e], programs[a] = insert(ev, new_e), insert(ac, new_a)
            changed = changed or bool(moves)
        return replace(self.compiled, programs=tuple(programs))

    def _knowledge(self, e: int, a: int) -> Knowledge:
        if (e, a) not in self._knows:
            self._knows[(e, a)] = knowledge(self._events, len(self.ranks), e, a)
        return self._knows[(e, a)]

    def _plan_pair(
        self, ev: RankView, ac: RankView, limit: float, knows: Knowledge
    ) -> tuple[list[Move], list[tuple[int, int, int]]]:
        """Moves on both ranks of a pair. Leading each transfer by its link time holds stashes
        longer; when the acceptor cannot take that, plan with shorter leads, down to none (the
        fewest stashes in flight), and let the simulated backward wait for a slow link."""
        tau = self.taus[(ev.rank, ac.rank)]
        for lead in (tau, tau / 2, tau / 4, tau / 8) if tau > 0 else ():
            try:
                moves = plan_evictor(ev, limit, self.size, lead)
                return moves, place_on_acceptor(ev, ac, moves, limit, self.size, knows)
            except Infeasible:
                continue  # shorter leads hold fewer stashes at once
        moves = plan_evictor(ev, limit, self.size, 0.0)
        return moves, place_on_acceptor(ev, ac, moves, limit, self.size, knows)


def smallest_feasible_limit(compiled: Compiled, costs: CostModel) -> float:
    """The smallest memory limit (stashes per rank) eviction can hold these programs to:
    what a bare `--evict` asks for; ⌈(p+1)/2⌉ under 1F1B."""
    return EvictionPlanner(compiled, costs).smallest_feasible()


def insert_evictions(compiled: Compiled, costs: CostModel, limit: float) -> Compiled:
    """Add BPipe's stash moves so that every rank stays within `limit` stashes.

    Expects lowered, deadlock-free programs without stash moves; guarantees programs that
    verify (residency and memory invariants included), with the moves Belady's rule needs.
    An infeasible limit is one PipecError naming the smallest feasible one.
    """
    return EvictionPlanner(compiled, costs).evict(limit)
