"""Building blocks (Qi et al., NeurIPS 2024): one micro-batch's passes at fixed slots, repeated.

The V placement gives rank r two stages: chunk 0 is stage r, chunk 1 is stage 2p-1-r. Each
rank runs six passes per micro-batch, named as in the paper's code: F and f, the forwards of
chunk 0 and chunk 1; B and b, the input-gradient backwards of chunk 1 and chunk 0 (the
backward meets chunk 1 first); W and w, their weight-gradient passes. A building block says
in which slot (one chunk pass with unit costs) rank r runs each pass of micro-batch 0;
micro-batch k runs T = 6 slots later. The construction works in slots; the order it decides
is then timed under real costs by the simulator, like every other schedule.

An order is, per rank, a list of pass names; the n-th F of a rank is micro-batch n's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import accumulate

from pipec.ir import Instr, Op, Program
from pipec.passes.costs import CostModel

T = 6
KINDS = "FfBbWw"
Orders = list[list[str]]
Block = list[list[int]]
"""Per rank, the slots of micro-batch 0's F, f, B, b, W, w."""

#: The pass each pass waits for, by name: (rank offset, name), or None for the first F.
_WAITS_FOR = {
    "F": (-1, "F"),
    "f": (1, "f"),
    "B": (-1, "B"),
    "b": (1, "b"),
    "W": (0, "B"),
    "w": (0, "b"),
}
#: At the ends of the V the pass before is on the same rank (where the V turns, or the loss).
_TURN = {"f": "F", "B": "f", "b": "B"}
#: Activation memory of a pass in chunk stashes (the count the lifespan rule bounds).
MEM = {"F": 1, "f": 1, "B": 0, "b": 0, "W": -1, "w": -1, " ": 0}


def waits_for(p: int, rank: int, kind: str) -> tuple[int, str] | None:
    """The (rank, pass) that the same micro-batch's `kind` on `rank` waits for."""
    step, dep = _WAITS_FOR[kind]
    other = rank + step
    if 0 <= other < p:
        return other, dep
    if kind == "F":
        return None
    return rank, _TURN[kind]


def block_from_residues(p: int, residues: list[list[int]]) -> Block | None:
    """Micro-batch 0's slots from each rank's slots modulo T for F, f, B, b.

    Each pass takes the first slot after the pass it waits for that has its residue (the F
    chain up the ranks, f back down, B up, b down); W and w take the first residues left free
    after B and b. None when two passes of a rank share a residue: repeated, they collide.
    """
    block = [[0] * 6 for _ in range(p)]
    t = -1
    for kind, ranks in (
        (0, range(p)),
        (1, range(p - 1, -1, -1)),
        (2, range(p)),
        (3, range(p - 1, -1, -1)),
    ):
        for r in ranks:
            t += 1 + (residues[r][kind] - t - 1) % T
            block[r][kind] = t
    for slots in block:
        used = {s % T for s in slots[:4]}
        if len(used) < 4:
            return None
        for src, dst in ((2, 4), (3, 5)):
            k = 1
            while (slots[src] + k) % T in used:
                k += 1
            used.add((slots[src] + k) % T)
            slots[dst] = slots[src] + k
    return block


def repeat(block: Block, m: int) -> Orders:
    """Each rank's order when micro-batch k runs the block shifted by k·T slots."""
    return [
        [KINDS[c] for _, c in sorted((s + T * k, c) for k in range(m) for c, s in enumerate(slots))]
        for slots in block
    ]


Durations = list[dict[str, float]]
"""Per rank, how long each pass takes (unit slots when none are given)."""


def durations(p: int, costs: CostModel) -> Durations:
    """Each rank's pass durations: chunk 0 is stage r, chunk 1 is stage 2p-1-r."""
    out = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        get = costs.per_chunk
        out.append(
            {
                "F": get("F", c0),
                "f": get("F", c1),
                "B": get("B", c1),
                "b": get("B", c0),
                "W": get("W", c1),
                "w": get("W", c0),
            }
        )
    return out


def start_times(
    orders: Orders, dur: Durations | None = None, comm: float | Sequence[Sequence[float]] = 0
) -> list[list[float]] | None:
    """When every pass starts if each starts as early as its rank's order and its input
    allow (with unit durations: the paper's "squeeze", in slots); None if the orders
    deadlock. `comm` is added when the input comes from another rank (`comm[src][dst]`: each
    pair of ranks its own delay)."""
    p = len(orders)
    unit = {k: 1 for k in KINDS}
    delay = comm if isinstance(comm, Sequence) else [[comm] * p for _ in range(p)]
    deps = [
        {
            k: None if d is None else (d[0], d[1], delay[d[0]][r] if d[0] != r else 0)
            for k in KINDS
            for d in [waits_for(p, r, k)]
        }
        for r in range(p)
    ]
    ends: list[dict[str, list[float]]] = [{k: [] for k in KINDS} for _ in range(p)]
    waiting: list[dict[str, list[int]]] = [{k: [] for k in KINDS} for _ in range(p)]
    out: list[list[float]] = [[] for _ in range(p)]
    clock = [0] * p
    ready = list(range(p))
    while ready:
        r = ready.pop()
        row, starts, mine = orders[r], out[r], ends[r]
        cost = dur[r] if dur else unit
        t = clock[r]
        while len(starts) < len(row):
            kind = row[len(starts)]
            done = mine[kind]
            dep = deps[r][kind]
            if dep is not None:
                theirs = ends[dep[0]][dep[1]]
                if len(theirs) <= len(done):
                    waiting[dep[0]][dep[1]].append(r)
                    break
                arrive = theirs[len(done)] + dep[2]
                if arrive > t:  # noqa: PLR1730 - a compare, not a call of max(): a hot loop
                    t = arrive
            starts.append(t)
            t += cost[kind]
            done.append(t)
            if waiting[r][kind]:
                ready += waiting[r][kind]
                waiting[r][kind] = []
        clock[r] = t
    return out if all(len(t) == len(row) for t, row in zip(out, orders)) else None


def slot_times(orders: Orders) -> list[list[int]] | None:
    """start_times with unit durations: the slot of every pass."""
    return start_times(orders)  # type: ignore[return-value]  (unit costs keep ints)


def to_grid(orders: Orders, times: list[list[int]]) -> list[list[str]]:
    """Rows of slots, ' ' where a rank idles."""
    length = max((t[-1] + 1 for t in times if t), default=0)
    grid = [[" "] * length for _ in orders]
    for row, cells, ts in zip(orders, grid, times):
        for kind, t in zip(row, ts):
            cells[t] = kind
    return grid


def from_grid(grid: list[list[str]]) -> Orders:
    return [[c for c in row if c != " "] for row in grid]


def squeezed(orders: Orders) -> list[list[str]] | None:
    """The grid of the orders started as early as possible; None if they deadlock."""
    times = slot_times(orders)
    return None if times is None else to_grid(orders, times)


def peak(row: list[str]) -> int:
    """A rank's peak live chunk stashes: F and f add one, W and w free one."""
    return max(accumulate(map(MEM.__getitem__, row), initial=0))


def relabel_w(orders: Orders) -> Orders:
    """Give every W/w slot to the oldest finished B/b: weight passes run in FIFO order."""
    out = []
    for row in orders:
        queue: deque[str] = deque()
        new = []
        for kind in row:
            if kind in "Bb":
                queue.append("W" if kind == "B" else "w")
            elif kind in "Ww":
                kind = queue.popleft()
            new.append(kind)
        out.append(new)
    return out


def first_of(row: list[str], m: int) -> list[str]:
    """The row without the passes of micro-batches m and beyond (the n-th pass of a kind is
    micro-batch n's)."""
    count = dict.fromkeys(KINDS, 0)
    out = []
    for kind in row:
        if count[kind] < m:
            out.append(kind)
            count[kind] += 1
    return out


def keep_first(orders: Orders, m: int) -> Orders:
    """Drop the passes of micro-batches m and beyond (built with spare ones, see vreorder)."""
    return relabel_w([first_of(row, m) for row in orders])


def to_programs(p: int, orders: Orders) -> tuple[Program, ...]:
    """The compute order of each rank as instructions (stage r for chunk 0, 2p-1-r for 1)."""
    programs = []
    for r, row in enumerate(orders):
        count = dict.fromkeys(KINDS, 0)
        program = []
        for kind in row:
            op = {"F": Op.F, "B": Op.B, "W": Op.W}[kind.upper()]
            stage = r if kind in "Fbw" else 2 * p - 1 - r
            program.append(Instr(op, stage, count[kind]))
            count[kind] += 1
        programs.append(tuple(program))
    return tuple(programs)
