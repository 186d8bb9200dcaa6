"""Each rank's live activation stash over the simulated time: the Gantt chart's memory strips.

The simulator reports a rank's peak (`passes/simulate.py`'s `activation_profile`, counted in
program order); this pass places the same counts on the timeline. A change takes effect when
its op starts if it adds memory (F, RECOMPUTE, LOAD, ACCEPT) and when it ends if it frees
memory (B, W, BW, EVICT, RETURN), so the strip never dips below what the rank holds; stash
moves take their times from the simulated transfers. Times never go back along a rank's
program, so the values are the program-order counts and the strip's highest point is the
reported peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from operator import attrgetter, getitem, itemgetter

from pipec.ir import COMPUTE_OPS, MEMORY_OPS, Instr, Layout, Op, op_kinds
from pipec.passes.costs import CostModel
from pipec.passes.simulate import SimResult, uses_recompute

#: Per stash-move op: the transfer it takes part in, the side of it this rank is on, and
#: whether its memory change counts from the transfer's start (else from its end).
_MOVE = {
    Op.EVICT: ("evict", "src", False),
    Op.ACCEPT: ("evict", "dst", True),
    Op.LOAD: ("load", "dst", True),
    Op.RETURN: ("load", "src", False),
}

Series = tuple[list[float], list[float]]
"""A rank's (times, live stash after each change), times non-decreasing."""


def stash_over_time(
    layout: Layout, programs: Sequence[Sequence[Instr]], costs: CostModel, sim: SimResult
) -> list[Series]:
    """Per rank, the live stash (in stashes, as the simulator's peaks) at each change."""
    recompute = uses_recompute(programs)
    delta = {op: costs.mem_delta(op, recompute) * layout.stash_share for op in Op}
    if not MEMORY_OPS & op_kinds(programs):  # no stash moves: the compute ops say it all
        return [_compute_only(slots, delta) for slots in sim.timeline]
    moves: dict[tuple, list] = {}
    for t in sim.transfers:
        moves.setdefault((t.kind, t.stage, t.mb, "src", t.src), []).append(t)
        moves.setdefault((t.kind, t.stage, t.mb, "dst", t.dst), []).append(t)
    for queue in moves.values():
        queue.reverse()  # popped from the end, first transfer first
    out = []
    for r, (prog, slots) in enumerate(zip(programs, sim.timeline)):
        times, lives, live, now, k = [], [], 0.0, 0.0, 0
        for instr in prog:
            if instr.op in COMPUTE_OPS:
                _, start, end = slots[k]
                k += 1
                when = start if delta[instr.op] > 0 else end
            elif instr.op in _MOVE:
                kind, side, at_start = _MOVE[instr.op]
                move = moves[(kind, instr.stage, instr.mb, side, r)].pop()
                when = move.start if at_start else move.end
            else:
                continue
            if delta[instr.op]:
                live += delta[instr.op]
                now = max(now, when)
                times.append(now)
                lives.append(live)
        out.append((times, lives))
    return out


def _compute_only(slots: Sequence, delta: dict) -> Series:
    """A rank's series from its compute ops alone, every op a point (those that change
    nothing repeat the value). Maps in C, no Python code per op: 10^5 ops on a large chart."""
    ops = list(map(attrgetter("op"), map(itemgetter(0), slots)))
    at = {op: 1 if d > 0 else 2 for op, d in delta.items()}  # a slot's start, or its end
    times = list(map(getitem, slots, map(at.__getitem__, ops)))
    return times, list(accumulate(map(delta.__getitem__, ops)))
