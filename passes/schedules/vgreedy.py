"""The zero-bubble repository's V-Min and V-Half orders (its `zbv_greedy`), in pure Python.

Qi et al. (NeurIPS 2024) turn a building block into a schedule in two published ways. The
adaptive search's way is vreorder's (repeat, squeeze, rewrite warm-up and cool-down); the
reference V-Min/V-Half generator instead moves passes into earlier free slots:

1. Repeat micro-batch 0's slots every T = 6 slots for m micro-batches, and give each B and b
   a weight pass in the first free slot after it (one queue for both).
2. Walk every pass in slot order. Outside the stable phase (which runs from rank 0's first b
   to the first last forward) move each pass to the earliest free slot after its inputs where
   its rank's peak stays within the largest peak any rank had; then squeeze.
3. Drop the weight passes and walk again, moving only passes after the stable phase (memory
   counted with the weight passes in the first free slots); put one queue of weight passes
   back and squeeze.
4. Put the weight passes back once more, W before w where both wait; each rank's order is
   its passes by slot.

Only the slots decide the order; it is timed under the real costs like every other order.
Slot lists are indexed [rank][kind][mb] with kinds in `KINDS` order (F f B b, then W, or W w).
"""

from __future__ import annotations

from pipec.passes.schedules.vblocks import KINDS, Orders

Slots = list[list[list[int]]]
"""Per rank, per kind, the slot of each micro-batch's pass."""


def orders(first: list[tuple[int, int, int, int]], m: int) -> Orders:
    """The order of each rank, from the slots of micro-batch 0's F, f, B, b on each rank."""
    slots = [[[s + 6 * k for k in range(m)] for s in row] for row in first]
    moved = _squeeze(_reorder([_put_weights(r, split=False) for r in slots], m, weights=True))
    again = _reorder([r[:4] for r in moved], m, weights=False)
    squeezed = _squeeze([_put_weights(r, split=False) for r in again])
    final = [_put_weights(r[:4], split=True) for r in squeezed]
    return [
        [KINDS[t] for _, t in sorted((s, t) for t, xs in enumerate(r) for s in xs)] for r in final
    ]


def _put_weights(rank: list[list[int]], split: bool) -> list[list[int]]:
    """The rank's F f B b slots plus its weight passes, each in the first free slot once its
    backward is done: one list (W and w in one queue), or two (W first where both wait)."""
    out = [list(xs) for xs in rank[:4]] + [[] for _ in range(1 + split)]
    pending = [0, 0]
    free = 0  # the first slot not yet looked at
    for at, kind in sorted((s, t) for t, xs in enumerate(rank[:4]) for s in xs):
        for slot in range(free, at):
            for w in (0, 1):
                if pending[w]:
                    out[4 + w].append(slot)
                    pending[w] -= 1
                    break
        if kind >= 2:
            pending[kind - 2 if split else 0] += 1
        free = at + 1
    for w in (0, 1):
        for _ in range(pending[w]):
            out[4 + w].append(free)
            free += 1
    return out


def _input_slot(cur: Slots, p: int, r: int, t: int, k: int) -> int:
    """The latest slot among the passes (r, t, k) waits for, by slot (-1 if none)."""
    dep = cur[r][t][k - 1] if k else -1
    if t in (0, 2) and r > 0:
        dep = max(dep, cur[r - 1][t][k])
    elif t in (1, 3) and r < p - 1:
        dep = max(dep, cur[r + 1][t][k])
    if 0 < t < 4:
        dep = max(dep, cur[r][t - 1][k])
    elif t == 4:  # the combined weight queue: the k-th backward of either chunk
        dep = max(dep, _kth(cur[r][2], cur[r][3], k))
    return dep


def _kth(a: list[int], b: list[int], k: int) -> int:
    """The k-th smallest (0-based) of two sorted lists together."""
    lo, hi = max(0, k + 1 - len(b)), min(k + 1, len(a))
    while lo < hi:  # how many of the k+1 smallest come from a
        i = (lo + hi) // 2
        if a[i] < b[k - i]:
            lo = i + 1
        else:
            hi = i
    return max(a[lo - 1] if lo else -1, b[k - lo] if k - lo >= 0 else -1)


def _reorder(cur: Slots, m: int, weights: bool) -> Slots:
    """Step 2 (`weights`: the lists hold a weight queue) or step 3 of the module docstring."""
    p = len(cur)
    length = max(xs[-1] for r in cur for xs in r) + 2
    memory = [_Memory(r, length, weights) for r in cur]
    cap = max(mem.peak() for mem in memory)
    taken = [bytearray(length) for _ in range(p)]
    phase = 0
    for at, r, t, k in sorted(
        (s, r, t, k)
        for r, row in enumerate(cur)
        for t, xs in enumerate(row)
        for k, s in enumerate(xs)
    ):
        if phase == 0 and r == 0 and t == 3:
            phase = 1
        if phase == 1 and t == 0 and k == m - 1:
            phase = 2
        elif phase == 2 or (phase == 0 and weights):
            to = memory[r].earliest(_input_slot(cur, p, r, t, k) + 1, at, t, taken[r], cap)
            if to != at:
                cur[r][t][k] = to
                memory[r].move(t, at, to)
            at = to
        taken[r][at] = 1
    return cur


class _Memory:
    """One rank's live chunk stashes after each slot, as passes move to earlier slots.

    With a weight queue in the lists, F and f add one, weight passes free one. Without, a
    pending weight pass frees one in each free slot (step 3's count)."""

    def __init__(self, rank: list[list[int]], length: int, weights: bool) -> None:
        self.weights = weights
        self.kind = [-1] * length
        for t, xs in enumerate(rank):
            for s in xs:
                self.kind[s] = t
        self.live = [0] * length
        self.queue = [0] * length
        self._refresh(0, len(self.kind))

    def _refresh(self, start: int, changed: int) -> None:
        """Recount from `start`; past `changed` (the last slot that changed), stop where the
        count meets the old one again."""
        kind, lives, queues = self.kind, self.live, self.queue
        live, queue = (lives[start - 1], queues[start - 1]) if start else (0, 0)
        for x in range(start, len(kind)):
            live, queue = self._step(kind[x], live, queue)
            if x > changed and live == lives[x] and queue == queues[x]:
                return
            lives[x], queues[x] = live, queue

    def _step(self, kind: int, live: int, queue: int) -> tuple[int, int]:
        if kind in (0, 1):
            return live + 1, queue
        if self.weights:
            return (live - 1, queue) if kind >= 4 else (live, queue)
        if kind >= 2:
            return live, queue + 1
        return (live - 1, queue - 1) if queue else (live, queue)

    def peak(self) -> int:
        return max(self.live)

    def earliest(self, lo: int, at: int, t: int, taken: bytearray, cap: int) -> int:
        """The first free slot in [lo, at) where the pass at `at` may go, else `at`."""
        if self.weights:  # only a forward moved earlier raises the count, over [to, at)
            if t in (0, 1):
                floor = at
                while floor > lo and self.live[floor - 1] < cap:
                    floor -= 1
                lo = floor
            for to in range(lo, at):
                if not taken[to]:
                    return to
            return at
        for to in range(lo, at):
            if not taken[to] and self._fits(t, at, to, cap):
                return to
        return at

    def _fits(self, t: int, at: int, to: int, cap: int) -> bool:
        """Whether moving the pass of kind t from `at` to `to` keeps the peak within cap."""
        kind, live, queue = self.kind, self.live, self.queue
        state = (live[to - 1], queue[to - 1]) if to else (0, 0)
        for x in range(to, len(kind)):
            here = t if x == to else -1 if x == at else kind[x]
            state = self._step(here, *state)
            if state[0] > cap:
                return False
            if x > at and state == (live[x], queue[x]):
                return True  # from here on nothing changed
        return True

    def move(self, t: int, at: int, to: int) -> None:
        self.kind[to], self.kind[at] = t, -1
        self._refresh(to, at)


def _squeeze(cur: Slots) -> Slots:
    """Every pass as early as its rank's slot order and its inputs allow (unit passes)."""
    p = len(cur)
    out = [[[0] * len(xs) for xs in row] for row in cur]
    free = [0] * p
    for _, r, t, k in sorted(
        (s, r, t, k)
        for r, row in enumerate(cur)
        for t, xs in enumerate(row)
        for k, s in enumerate(xs)
    ):
        start = free[r]
        if k:
            start = max(start, out[r][t][k - 1] + 1)
        if t in (0, 2) and r > 0:
            start = max(start, out[r - 1][t][k] + 1)
        elif t in (1, 3) and r < p - 1:
            start = max(start, out[r + 1][t][k] + 1)
        if 0 < t < 4:
            start = max(start, out[r][t - 1][k] + 1)
        out[r][t][k] = start
        free[r] = start + 1
    return out
