"""Play rank programs against a cost model: timeline, iteration time, bubbles, peak memory.

Semantics are the runtime's: sends are non-blocking and receives are posted early, so a
compute op starts when its rank is free and every input has arrived (the producer's end, plus
`comm` when the producer is on another rank). An OVERLAP pair (DualPipe's F&B) starts as one
unit, once the inputs of both its forward and its backward have arrived; it then costs what
its two ops cost one after the other (no speed-up from overlapping is assumed), and each
op's output leaves when that op ends. That is the longest path over the DAG of program
order and data edges; it is computed with one worklist pass, O(number of instructions), so a
p=64, m=1024 schedule simulates in well under a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from passes.costs import CostModel
from passes.replicas import sync_times
from pipec.ir import COMPUTE_OPS, Instr, Layout, Op, PipecError, dependencies, fused_backwards

Node = tuple[Op, int, int]


@dataclass(frozen=True)
class Slot:
    """One compute instruction's place on the simulated timeline."""

    instr: Instr
    start: float
    end: float


@dataclass(frozen=True)
class RankStats:
    """`params`: parameter memory in units of one rank's share of one model copy (2 where a
    rank holds two replicas); `sync`: how long the rank's replica all-reduces run past its
    last compute op (the part of the gradient sync that compute did not hide)."""

    busy: float
    span: float
    peak_activations: float
    params: float
    sync: float


@dataclass(frozen=True)
class SimResult:
    """The figures a user asks for, and the timeline they come from.

    `bubble` = 1 - sum(busy) / (p * makespan): what an iteration costs in wall time.
    `span_bubble` = 1 - max(busy) / max(span), span = first start to last end on a rank:
    the zero-bubble papers' metric. The makespan includes replica all-reduces that outlast
    the compute; spans do not.
    """

    makespan: float
    bubble: float
    span_bubble: float
    ranks: tuple[RankStats, ...]
    timeline: tuple[tuple[Slot, ...], ...]

    def to_json(self) -> dict:
        return {
            "makespan": _round(self.makespan),
            "bubble": _round(self.bubble),
            "span_bubble": _round(self.span_bubble),
            "ranks": [
                {
                    "rank": r,
                    "busy": _round(s.busy),
                    "span": _round(s.span),
                    "peak_activations": _round(s.peak_activations),
                    "params": _round(s.params),
                    "sync": _round(s.sync),
                }
                for r, s in enumerate(self.ranks)
            ],
        }


def _round(x: float) -> float:
    """Round away float noise so printed and serialised figures are stable."""
    return round(x, 9) + 0.0


def uses_recompute(programs: Sequence[Sequence[Instr]]) -> bool:
    return any(i.op is Op.RECOMPUTE for prog in programs for i in prog)


def overlap_starts(program: Sequence[Instr]) -> set[int]:
    """Indices, counting compute ops only, of the first op of each OVERLAP pair."""
    starts, k, marked = set(), 0, False
    for instr in program:
        if instr.op is Op.OVERLAP:
            marked = True
        elif instr.op in COMPUTE_OPS:
            if marked:
                starts.add(k)
            marked = False
            k += 1
    return starts


def play(
    layout: Layout, programs: Sequence[Sequence[Instr]], costs: CostModel
) -> tuple[dict[Node, tuple[float, float]], list[Node]]:
    """Start and end time of every compute op, and the order in which they completed.

    The completion order is a topological order of program order plus data edges, and ends
    are non-decreasing along every such edge, so (end, position) orders events causally.
    A program that can never finish (a cycle) is a PipecError naming each stuck rank.
    """
    recompute = uses_recompute(programs)
    fused = fused_backwards(programs)
    rank_of = layout.stage_rank
    compute = [[i for i in prog if i.op in COMPUTE_OPS] for prog in programs]
    paired = [overlap_starts(prog) for prog in programs]
    times: dict[Node, tuple[float, float]] = {}
    done_order: list[Node] = []
    waiting: dict[Node, list[int]] = {}
    pos = [0] * len(compute)
    clock = [0.0] * len(compute)
    ready = list(range(len(compute)))
    comm = costs.comm
    while ready:
        r = ready.pop()
        order, k, t = compute[r], pos[r], clock[r]
        while k < len(order):
            instr = order[k]
            node = (instr.op, instr.stage, instr.mb)
            start = t
            blocked = None
            deps = dependencies(layout, node, recompute, fused)
            if k in paired[r]:  # the pair starts once the inputs of both ops are in
                second = (order[k + 1].op, order[k + 1].stage, order[k + 1].mb)
                deps = chain(deps, dependencies(layout, second, recompute, fused))
            for dep in deps:
                finished = times.get(dep)
                if finished is None:
                    blocked = dep
                    break
                arrive = finished[1] + (comm if rank_of[dep[1]] != r else 0.0)
                if arrive > start:
                    start = arrive
            if blocked is not None:
                waiting.setdefault(blocked, []).append(r)
                break
            t = start + costs.duration(instr, layout)
            times[node] = (start, t)
            done_order.append(node)
            ready.extend(waiting.pop(node, ()))
            k += 1
        pos[r], clock[r] = k, t
    stuck = [r for r in range(len(compute)) if pos[r] < len(compute[r])]
    if stuck:
        where = "; ".join(f"rank {r} at {compute[r][pos[r]]}" for r in stuck[:4])
        raise PipecError(f"the schedule cannot finish (a dependency cycle): {where}")
    return times, done_order


def activation_profile(
    program: Sequence[Instr], layout: Layout, costs: CostModel, recompute: bool
) -> list[float]:
    """Live activation memory after each instruction of one rank's program, in stashes."""
    live, out = 0.0, []
    share = layout.stash_share
    for instr in program:
        live += costs.mem_delta(instr.op, recompute) * share
        out.append(live)
    return out


def simulate(layout: Layout, programs: Sequence[Sequence[Instr]], costs: CostModel) -> SimResult:
    """Simulate the programs (compute orders or lowered programs) under `costs`."""
    times, _ = play(layout, programs, costs)
    synced = sync_times(layout, programs, times, costs)
    recompute = uses_recompute(programs)
    timeline, ranks = [], []
    for r, prog in enumerate(programs):
        slots = tuple(
            Slot(i, *times[(i.op, i.stage, i.mb)]) for i in prog if i.op in COMPUTE_OPS
        )
        busy = sum(s.end - s.start for s in slots)
        span = slots[-1].end - slots[0].start if slots else 0.0
        peak = max([0.0, *activation_profile(prog, layout, costs, recompute)])
        sync = max(0.0, synced[r] - (slots[-1].end if slots else 0.0))
        timeline.append(slots)
        ranks.append(RankStats(busy, span, peak, layout.params_of_rank(r), sync))
    makespan = max(synced + [s[-1].end for s in timeline if s], default=0.0)
    total_busy = sum(r.busy for r in ranks)
    bubble = 1 - total_busy / (len(programs) * makespan) if makespan > 0 else 0.0
    max_span = max(r.span for r in ranks)
    span_bubble = 1 - max(r.busy for r in ranks) / max_span if max_span > 0 else 0.0
    return SimResult(makespan, bubble, span_bubble, tuple(ranks), tuple(timeline))
