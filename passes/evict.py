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
import math
from dataclasses import replace
from functools import cached_property

from pipec.ir import Compiled, Instr, Layout, Op, PipecError
from pipec.passes.costs import CostModel
from pipec.passes.evict_plan import (
    EPS,
    Infeasible,
    Move,
    RankView,
    insert,
    place_on_acceptor,
    plan_evictor,
    view,
)
from pipec.passes.mapping import mirror_pairs
from pipec.passes.rendezvous import Keys, knowledge, message_keys
from pipec.passes.residency import NEEDS_MODEL
from pipec.passes.simulate import activation_profile, play, uses_recompute

Knowledge = tuple[list[int], list[int]]


class EvictionPlanner:
    """One simulation of the programs, then evictions for any number of memory limits.

    Limits are in stashes (one rank's full share), or with `in_bytes` in bytes of stash: each
    stash weighs its stage's measured `costs.stash_bytes`, wherever it lives (the measure of
    the simulator's `peak_stash_bytes`)."""

    def __init__(self, compiled: Compiled, costs: CostModel, in_bytes: bool = False) -> None:
        layout, programs = compiled.layout, compiled.programs
        recompute = uses_recompute(programs)
        times = play(layout, programs, costs).times
        weight = stash_weights(layout, costs, in_bytes)
        self.compiled, self.layout, self.in_bytes = compiled, layout, in_bytes
        self.ranks = [
            view(r, prog, times, activation_profile(prog, layout, costs, recompute, weight))
            for r, prog in enumerate(programs)
        ]
        peak = [rk.peak for rk in self.ranks]
        self.pairs = [(a, b) if peak[a] >= peak[b] else (b, a) for a, b in mirror_pairs(layout)]
        self.size = costs.stash_size(recompute) * layout.stash_share  # what a transfer moves
        chunk = layout.stage_chunk
        # The memory an evicted stash of each stage frees, in the limit's measure.
        self.held = [costs.stash_size(recompute) * weight[chunk[s]] for s in range(len(chunk))]
        self.taus = {
            (e, a): max(costs.transfer_time(e, a, self.size), costs.transfer_time(a, e, self.size))
            for e, a in self.pairs
        }
        self._knows: dict[tuple[int, int], Knowledge] = {}
        self._memo: dict[Instr, tuple] = {}  # a message's counterpart key
        self._done: dict[float, Compiled] = {}

    @property
    def peak(self) -> float:
        return max(rk.peak for rk in self.ranks)

    @cached_property
    def _keys(self) -> list[Keys]:
        return [message_keys(self.compiled, r, self._memo) for r in range(len(self.ranks))]

    def evict(self, limit: float) -> Compiled:
        """The programs with every rank held to `limit` (stashes, or bytes); an infeasible
        limit is one PipecError naming the smallest feasible one."""
        try:
            return self._apply(limit)
        except Infeasible as e:
            raise PipecError(
                f"--memory-limit {self.amount(limit)} is infeasible with --evict ({e}); "
                f"the smallest feasible limit is {self.amount(self.smallest_feasible())}"
            ) from None

    def amount(self, x: float) -> str:
        return amount(x, self.in_bytes)

    def smallest_feasible(self) -> float:
        """The smallest limit eviction meets, searched over the levels a rank can reach (a
        level without eviction, plus or minus whole stashes of its pair's stages). The first
        probe is the balanced bound of the fullest pair, half its two peaks (⌈(p+1)/2⌉ under
        1F1B); then a binary search, where an infeasible probe usually fails fast on the
        first pair."""
        top = self.peak
        if max(self.held) <= EPS:
            return top
        candidates = sorted({v for v in self._reachable() if min(self.held) - EPS <= v < top})
        candidates.append(top)
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

    def _reachable(self) -> set[float]:
        """Levels of each rank plus or minus whole stashes of its pair's stages (ranks whose
        pairs move stashes of the same sizes are taken together)."""
        partner = {r: q for pair in self.pairs for r, q in (pair, pair[::-1])}
        groups: dict[frozenset[float], set[float]] = {}
        for rk in self.ranks:
            both = self.layout.stages_of_rank(rk.rank) + self.layout.stages_of_rank(
                partner.get(rk.rank, rk.rank)
            )
            sizes = frozenset(round(self.held[s], 9) for s in both) - {0.0}
            groups.setdefault(sizes, set()).update(rk.level)
        out: set[float] = set()
        top = self.peak
        for sizes, levels in groups.items():
            for size in sizes:
                steps = int(top / size + EPS) + 1
                out.update(round(v + k * size, 9) for v in levels for k in range(-steps, steps + 1))
        return out

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
                raise Infeasible(f"rank {rk.rank} holds {self.amount(rk.peak)} and has no partner")
        programs = list(self.compiled.programs)
        now, keys = self.compiled, list(self._keys)
        for e, a in self.pairs:
            ev, ac = self.ranks[e], self.ranks[a]
            if ev.peak <= limit + EPS:
                continue
            if ac.peak > limit + EPS:
                raise Infeasible(
                    f"rank {a} holds {self.amount(ac.peak)} of its own, "
                    f"so it cannot take rank {e}'s"
                )
            if now is not self.compiled:  # against the programs with earlier pairs' moves in
                knows = knowledge(now, keys, e, a)
            else:
                knows = self._knowledge(e, a)
            moves, placed = self._plan_pair(ev, ac, limit, knows)
            new_e, new_a = [], []
            for (gap_e, _, _, kind, (s, mb)), (gap_a, j, i) in zip(moves, placed):
                ops = (Op.EVICT, Op.ACCEPT) if kind == "evict" else (Op.LOAD, Op.RETURN)
                new_e.append((gap_e, j, Instr(ops[0], s, mb, a)))
                new_a.append((gap_a, i, Instr(ops[1], s, mb, e)))
            programs[e], programs[a] = insert(ev, new_e), insert(ac, new_a)
            if moves:
                now = replace(self.compiled, programs=tuple(programs))
                keys[e], keys[a] = (
                    message_keys(now, e, self._memo),
                    message_keys(now, a, self._memo),
                )
        return now

    def _knowledge(self, e: int, a: int) -> Knowledge:
        if (e, a) not in self._knows:
            self._knows[(e, a)] = knowledge(self.compiled, self._keys, e, a)
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
                moves = plan_evictor(ev, limit, self.held, lead)
                return moves, place_on_acceptor(ev, ac, moves, limit, self.held, knows)
            except Infeasible:
                continue  # shorter leads hold fewer stashes at once
        moves = plan_evictor(ev, limit, self.held, 0.0)
        return moves, place_on_acceptor(ev, ac, moves, limit, self.held, knows)


def amount(x: float, in_bytes: bool) -> str:
    """A memory limit as the user writes it: stashes, or bytes (rounded up, so that a
    feasible figure stays feasible)."""
    return f"{math.ceil(x - 1e-6)}B ({x / 2**20:.3g} MiB)" if in_bytes else f"{x:g}"


def stash_weights(layout: Layout, costs: CostModel, in_bytes: bool) -> list[float]:
    """What one micro-batch's F of each chunk adds per unit of `mem_F`: stashes of one rank's
    share (`layout.stash_share`), or with `in_bytes` the chunk's measured bytes."""
    if not in_bytes:
        return [layout.stash_share] * layout.n_chunks
    if not costs.stash_bytes:
        raise PipecError(NEEDS_MODEL)
    return [b / costs.mem_F for b in costs.stash_bytes]


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
