"""Repeat, squeeze, reorder: turning a building block into a schedule (Qi et al., NeurIPS 2024).

Repeating a block gives the stable phase its memory (the lifespan rule) but a poor warm-up
and cool-down. Three passes improve them without raising any rank's peak: the warm-up is
rewritten as the V's natural one (forwards of chunk 0, then pairs F f, then B W f), the
cool-down is rebuilt with the last backwards chained as tightly as the V allows, and every
remaining idle slot is filled by the first later pass of its rank that can legally move
there. W and w take their free slots in FIFO order of the B and b they follow. A second
cool-down (list scheduling: B or b when ready, else the oldest W) is also built, since the
paper's rebuild can collide on some blocks; `variants` returns both and the caller keeps the
shorter under its costs. With `shared` peaks every rank may rise to the largest rank's peak
and a rebuilt B may take a weight pass's slot: how the reference code's adaptive search
builds a block.
"""

from __future__ import annotations

from collections import deque

from pipec.passes.schedules.vblocks import (
    KINDS,
    MEM,
    Block,
    Orders,
    from_grid,
    keep_first,
    peak,
    relabel_w,
    repeat,
    slot_times,
    squeezed,
    to_grid,
    waits_for,
)


def reorder_warmup(orders: Orders, m: int, tops: list[int]) -> Orders:
    """Rewrite each rank's passes before its first b as the V's warm-up.

    Rank r keeps the same passes but runs them as: chunk-0 forwards, then pairs F f (at most
    r+1 f, and as many F as leave room for them under its peak `tops[r]`), then B W f groups (F
    once the f run out). The multiset before the first b is unchanged, so is the memory there.
    """
    p = len(orders)
    return [_warmup(row, r, p, m, tops[r]) for r, row in enumerate(orders)]


def _warmup(row: list[str], r: int, p: int, m: int, top: int) -> list[str]:
    """Rank r's row with its passes before the first b reordered (see reorder_warmup)."""
    cut = row.index("b")
    have = {k: row[:cut].count(k) for k in "FfBW"}
    used = dict.fromkeys("FfBW", 0)
    n_f1 = min(r + 1, top // 2, m)
    limit = {"F": min(top - n_f1, m), "f": n_f1, "B": m, "W": m}
    new: list[str] = []

    def put(kind: str, capped: bool = True) -> None:
        if used[kind] < have[kind] and (not capped or used[kind] < limit[kind]):
            new.append(kind)
            used[kind] += 1

    for _ in range(2 * (p - 1 - r)):
        put("F")
    for _ in range(r + 1):
        put("F")
        put("f")
    while any(used[k] < have[k] for k in "FfBW"):
        put("B", False)
        put("W", False)
        put("f" if used["f"] < have["f"] else "F", False)
    return new + row[cut:]


def rebuild_cooldown(grid: list[list[str]], m: int, over_weights: bool = False) -> Orders | None:
    """The paper's cool-down: after rank 0's last f at slot S, rank r runs its last b's at
    S - r + 2p - 2k and its last B's at S + 1 + r - 2k (k = 0, 1, ...: chained as tightly as
    the V allows), (top+1)//2 b's and up to r+1 B's of them; the W's taken out of the tail
    go back into free slots after the last W left. With `over_weights` a B may take a weight
    pass's slot (that weight pass goes back with the others, as the reference code's adaptive
    search does). None if a chained slot is taken otherwise."""
    p = len(grid)
    top = max(peak(row) for row in grid)
    max_b1 = min((top + 1) // 2, m)
    max_b0 = min(top - max_b1, m)
    rows = [list(row) + [" "] * (4 * p) for row in grid]
    start = max(j for j, c in enumerate(rows[0]) if c == "f")
    for r, row in enumerate(rows):
        taken = dict.fromkeys("BbWw", 0)
        for j in range(len(row) - 1, -1, -1):
            if row[j] == "B" and taken["B"] < min(r + 1, max_b0):
                row[j], taken["B"] = " ", taken["B"] + 1
            elif row[j] == "b" and taken["b"] < max_b1:
                row[j], taken["b"] = " ", taken["b"] + 1
        for j in range(len(row) - 1, -1, -1):
            done_w = taken["W"] >= taken["B"] and taken["w"] >= taken["b"]
            if done_w and taken["W"] + taken["w"] >= top:
                break
            if row[j] in "Ww":
                taken[row[j]] += 1
                row[j] = " "
        over = " Ww" if over_weights else " "
        for kind, first, free in (("b", start - r + 2 * p, " "), ("B", start + 1 + r, over)):
            for k in range(taken[kind]):
                slot = first - 2 * k
                if slot < 0 or row[slot] not in free:
                    return None
                row[slot] = kind
    return [_refill_weights(row) for row in rows]


def _refill_weights(row: list[str]) -> list[str]:
    """Put the missing W/w in the free slots after the row's last weight pass, then append."""
    last = max((j for j, c in enumerate(row) if c in "Ww"), default=-1)
    owed = {"W": 0, "w": 0}
    for j, kind in enumerate(row):
        if kind in "Bb":
            owed["W" if kind == "B" else "w"] += 1
        elif kind in "Ww":
            owed[kind] -= 1
        elif kind == " " and j > last:
            for w in "Ww":
                if owed[w] > 0:
                    row[j], owed[w] = w, owed[w] - 1
                    break
    return [c for c in row if c != " "] + ["W"] * owed["W"] + ["w"] * owed["w"]


def list_cooldown(grid: list[list[str]]) -> Orders:
    """After each rank's last forward: B, else b, as soon as its input is there, else the
    oldest pending W (FIFO), else idle."""
    p = len(grid)
    cut = [max(j for j, c in enumerate(row) if c in "Ff") + 1 for row in grid]
    count = [dict.fromkeys(KINDS, 0) for _ in range(p)]
    at: dict[tuple[int, str, int], int] = {}
    rows, todo, owed = [], [], []
    for r, row in enumerate(grid):
        queue: deque[str] = deque()
        for j, kind in enumerate(row[: cut[r]]):
            if kind == " ":
                continue
            at[(r, kind, count[r][kind])] = j
            count[r][kind] += 1
            if kind in "Bb":
                queue.append("W" if kind == "B" else "w")
            elif kind in "Ww":
                queue.popleft()
        todo.append({k: row[cut[r] :].count(k) for k in "Bb"})
        owed.append(queue)
        rows.append(list(row[: cut[r]]))
    left = sum(2 * (t["B"] + t["b"]) + len(q) for t, q in zip(todo, owed))
    t = min(cut)
    while left:
        placed = []
        for r in range(p):
            if t < cut[r]:
                continue
            choice = None
            for kind in "Bb":
                if todo[r][kind]:
                    dep = waits_for(p, r, kind)
                    done = at.get((dep[0], dep[1], count[r][kind]))
                    if done is not None and done < t:
                        choice = kind
                        break
            if choice is None and owed[r]:
                choice = owed[r].popleft()
            rows[r] += [" "] * (t - len(rows[r]))
            if choice is None:
                continue
            rows[r].append(choice)
            placed.append(((r, choice, count[r][choice]), t))
            count[r][choice] += 1
            if choice in "Bb":
                todo[r][choice] -= 1
                owed[r].append("W" if choice == "B" else "w")
            left -= 1
        at.update(placed)  # a pass placed at t is visible to others only from t + 1
        t += 1
    return from_grid(rows)


def fill_bubbles(grid: list[list[str]], tops: list[int]) -> Orders:
    """Sweep the slots left to right; an idle slot takes a later pass of the same rank: the
    first one of its kind, the kinds in the order they come, whose input is ready there (an
    F or f only if moving it up keeps the rank's peak within `tops[r]`)."""
    p, length = len(grid), len(grid[0])
    last = [
        {k: max((j for j, c in enumerate(row) if c == k), default=-1) for k in KINDS}
        for row in grid
    ]
    count = [dict.fromkeys(KINDS, 0) for _ in range(p)]
    deps = [{k: waits_for(p, r, k) for k in KINDS} for r in range(p)]
    at: dict[tuple[int, str, int], int] = {}
    live = [0] * p
    for j in range(length):
        for r, row in enumerate(grid):
            if row[j] == " ":
                _pull_forward(row, j, last[r], count[r], at, live[r], tops[r], deps[r])
            kind = row[j]
            if kind != " ":
                at[(r, kind, count[r][kind])] = j
                count[r][kind] += 1
                live[r] += MEM[kind]
    return from_grid(grid)


def _pull_forward(
    row: list[str],
    j: int,
    last: dict[str, int],
    count: dict[str, int],
    at: dict[tuple[int, str, int], int],
    live: int,
    top: int,
    deps: dict[str, tuple[int, str] | None],
) -> None:
    """Move into row[j] the first pass after j that may run there (see fill_bubbles); `deps`
    is what each kind of pass waits for on this rank. Written out: the hottest loop of a
    V-shape search."""
    candidates = {k for k in KINDS if last[k] > j}
    delta = rise = 0
    for k in range(j + 1, len(row)):
        kind = row[k]
        if kind == " ":
            continue
        if not candidates:
            return
        rise_before = rise
        delta += MEM[kind]
        if delta > rise:  # noqa: PLR1730 - a compare, not a call of max(): a hot loop
            rise = delta
        if kind not in candidates:
            continue
        candidates.discard(kind)
        if MEM[kind] > 0 and live + rise_before >= top:
            continue  # the forward would be live over [j, k): the peak would rise
        dep = deps[kind]
        if dep is not None:
            done = at.get((dep[0], dep[1], count[kind]))
            if done is None or done >= j:
                continue
        row[j], row[k] = kind, " "
        if last[kind] == k:
            last[kind] = j
        return


def _peaks(orders: Orders | list[list[str]]) -> list[int]:
    return [peak(row) for row in orders]


def _within(orders: Orders, tops: list[int]) -> bool:
    return all(a <= b for a, b in zip(_peaks(orders), tops))


def variants(block: Block, m: int, thorough: bool = True, shared: bool = False) -> list[Orders]:
    """The schedules of `block` for m micro-batches: the paper's cool-down, then (`thorough`)
    list scheduling's; invalid ones are left out.

    Built with max(m, 2p) micro-batches so the warm-up rewrite sees a stable phase; the spare
    ones are dropped before the cool-down is reordered. No rank's peak rises above its peak
    in the repeated block (which the lifespan rule bounds), or with `shared` above the largest
    of them (the reference adaptive search's rule: a rank with room may use it).
    """
    p = len(block)

    def caps(orders: Orders | list[list[str]]) -> list[int]:
        peaks = _peaks(orders)
        return [max(peaks)] * p if shared else peaks

    spare = max(m, 2 * p)
    orders = repeat(block, spare)
    tops = caps(orders)
    warm = reorder_warmup(orders, spare, [min(t, 2 * p) for t in tops])
    times = slot_times(warm)
    if times is not None and _within(warm, tops):
        orders = warm
    else:
        times = None
    if spare > m:
        orders, times = keep_first(orders, m), None
    times = times or slot_times(orders)  # the warm-up's squeeze serves when nothing changed
    assert times is not None
    grid = to_grid(orders, times)
    found = []
    rebuilt = rebuild_cooldown(grid, m, over_weights=shared)
    if rebuilt is not None and (g := squeezed(relabel_w(rebuilt))) is not None:
        found.append(relabel_w(fill_bubbles(g, caps(g))))
    if thorough:
        filled = squeezed(relabel_w(fill_bubbles(grid, caps(grid))))
        assert filled is not None  # moving passes to earlier idle slots keeps them valid
        found.append(relabel_w(list_cooldown(filled)))
    # Filling bubbles and list scheduling keep every input before its use: no deadlock here.
    return [v for v in found if _within(v, tops)]


def every_variant(block: Block, m: int) -> list[Orders]:
    """`variants` with each rank within its own peak, then with every rank within the largest:
    where all ranks of the repeated block peak alike the two are the same orders (a rebuilt
    cool-down that needs no weight pass's slot is built the same way), so they are built once.
    """
    p = len(block)
    alike = len(set(_peaks(repeat(block, max(m, 2 * p))))) == 1
    return ([] if alike else variants(block, m)) + variants(block, m, shared=True)


def build(block: Block, m: int) -> Orders | None:
    """The shortest in slots of `variants(block, m)`, or None if there is none."""
    best, best_length = None, 0
    for v in variants(block, m):
        times = slot_times(v)
        assert times is not None
        length = max(t[-1] for t in times)
        if best is None or length < best_length:
            best, best_length = v, length
    return best
