"""Play rank programs against a cost model: timeline, iteration time, bubbles, peak memory.

Semantics are the runtime's: sends are non-blocking and receives are posted early, so a
compute op starts when its rank is free and every input has arrived (the producer's end, plus
the transfer time when the producer is on another rank: `comm`, or the link's time under a
topology). An OVERLAP pair (DualPipe's F&B) runs as the runtime runs it: its forward, then its
backward, each starting once its own input is there (no speed-up from overlapping is
assumed). With `overlap_as_one`, DeepSeek's accounting instead: the pair starts as one unit
once the inputs of both ops are in (its figures, e.g. the DualPipe bubble (PP/2-1)(F&B+B-3W),
are counted that way). Each op's output leaves when that op ends. That is the longest path
over the DAG of program order and data edges; it is computed with one worklist pass,
O(number of instructions). Stash moves (EVICT/ACCEPT, RETURN/LOAD) follow
`passes/transfers.py`; replica all-reduces `passes/replicas.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from operator import attrgetter
from typing import NamedTuple

from pipec.ir import (
    COMPUTE_OPS,
    MEMORY_OPS,
    Instr,
    Layout,
    Op,
    PipecError,
    dependency_table,
    fused_backwards,
    op_kinds,
    upstream_backward,
)
from pipec.passes.costs import CostModel
from pipec.passes.replicas import sync_times
from pipec.passes.transfers import Transfer, Transfers

Node = tuple[Op, int, int]


class Slot(NamedTuple):
    """One compute instruction's place on the simulated timeline (a named tuple: a compile
    makes 10^5 of them, and a frozen dataclass's __init__ is several times slower)."""

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
    peak_stash_bytes: float | None = None
    """The peak in bytes when the cost model has per-chunk stash bytes (a model was given)."""


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
    transfers: tuple[Transfer, ...] = ()

    @property
    def moved(self) -> float:
        """Stash units moved by evictions and loads in one iteration."""
        return sum(t.size for t in self.transfers)

    def to_json(self) -> dict:
        extra = {"moved_stashes": _round(self.moved)} if self.transfers else {}
        return extra | {
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
                | ({} if s.peak_stash_bytes is None else {"peak_stash_bytes": s.peak_stash_bytes})
                for r, s in enumerate(self.ranks)
            ],
        }


def _round(x: float) -> float:
    """Round away float noise so printed and serialised figures are stable."""
    return round(x, 9) + 0.0


def uses_recompute(programs: Sequence[Sequence[Instr]]) -> bool:
    """Whether the programs recompute forwards (which adds RECOMPUTE to the work graph)."""
    return Op.RECOMPUTE in op_kinds(programs)


class Played(NamedTuple):
    """What `play` found: each compute op's (start, end), the order the ops completed in, and
    each rank's compute ops as timeline slots, in program order."""

    times: dict[Node, tuple[float, float]]
    done_order: list[Node]
    slots: list[list[Slot]]


def overlap_starts(program: Sequence[Instr]) -> set[int]:
    """Indices of the first op of each OVERLAP pair, counting the ops `play` steps through
    (compute and stash moves)."""
    starts, k, marked = set(), 0, False
    for instr in program:
        if instr.op is Op.OVERLAP:
            marked = True
        elif instr.op in COMPUTE_OPS or instr.op in MEMORY_OPS:
            if marked:
                starts.add(k)
            marked = False
            k += 1
    return starts


def instruction_charges(program: Sequence[Instr], cost: float) -> tuple[float, ...]:
    """Per op `play` steps through (compute and stash moves, in program order), the runtime's
    own time for the instructions it stands for at `cost` each: a compute op's own, the
    instructions after it up to the next compute op (its sends, posted receives, stash moves;
    the runtime runs them right after it) and, for the first, those before it. A compute op
    ends that much later; a stash move is charged to the compute op before it."""
    played_ops = COMPUTE_OPS | MEMORY_OPS
    charges = [0.0] * sum(i.op in played_ops for i in program)
    last, before, k = None, 0, 0
    for instr in program:
        if instr.op in COMPUTE_OPS:
            last = k
            charges[k] = cost * (1 + before)
            before = 0
        elif last is None:
            before += 1
        else:
            charges[last] += cost
        k += instr.op in played_ops
    return tuple(charges)


def play(
    layout: Layout,
    programs: Sequence[Sequence[Instr]],
    costs: CostModel,
    transfers: Transfers | None = None,
    overlap_as_one: bool = False,
    measured: Mapping[Node, float] | None = None,
) -> Played:
    """Start and end time of every compute op, and the order in which they completed.

    The completion order is a topological order of program order plus data edges, and ends
    are non-decreasing along every such edge, so (end, position) orders events causally.
    A program that can never finish (a cycle) is a PipecError naming each stuck rank.
    Stash transfers are recorded in `transfers` when one is given. `overlap_as_one`: an
    OVERLAP pair waits for the inputs of both its ops (DeepSeek's accounting, see above).
    `measured`: each compute op's own duration (what a run measured), in place of the cost
    model's per stage: the schedule replayed with no wait but its messages' latency. With
    `costs.instr_overhead`, each compute op also takes the runtime's time for its
    instructions (`instruction_charges`).
    """
    costs = costs.of_chunks(layout.stash_share)  # a rank's share's costs: each chunk its part
    recompute = uses_recompute(programs)
    fused = fused_backwards(programs)
    rank_of = layout.stage_rank
    played_ops = COMPUTE_OPS | MEMORY_OPS
    compute = [[i for i in prog if i.op in played_ops] for prog in programs]
    charged = [
        instruction_charges(prog, costs.instr_overhead) if costs.instr_overhead else ()
        for prog in programs
    ]
    overlaps = overlap_as_one and Op.OVERLAP in op_kinds(programs)
    paired = [overlap_starts(prog) if overlaps else set() for prog in programs]
    times: dict[Node, tuple[float, float]] = {}
    done_order: list[Node] = []
    slots: list[list[Slot]] = [[] for _ in compute]
    waiting: dict[object, list[int]] = {}
    pos = [0] * len(compute)
    clock = [0.0] * len(compute)
    ready = list(range(len(compute)))
    size = costs.mem_input * layout.stash_share  # a stage input: what a message carries
    msg = [[costs.transfer_time(a, b, size) for b in range(layout.p)] for a in range(layout.p)]
    moves = transfers if transfers is not None else Transfers(layout, costs, recompute)
    # Per op kind, each stage's duration; per rank, each producer stage's message delay to it.
    stages = range(layout.n_stages)
    durations = {op: [costs.duration(Instr(op, st), layout) for st in stages] for op in COMPUTE_OPS}
    delay = [
        [msg[rank_of[st]][r] for st in stages] if r < layout.p else () for r in range(len(compute))
    ]
    table = dependency_table(layout, recompute)  # read inline: this loop is the hot path
    memory_ops = MEMORY_OPS
    times_get = times.get
    new = tuple.__new__  # Slot(...) runs Python code; this makes the same tuple in C
    while ready:
        r = ready.pop()
        order, k, t = compute[r], pos[r], clock[r]
        pairs, delay_r, end, slots_r = paired[r], delay[r], len(order), slots[r]
        charges = charged[r]
        while k < end:
            instr = order[k]
            op = instr.op
            if op in memory_ops:
                ready.extend(waiting.pop(moves.reach(r, instr, t), ()))
                k += 1
                continue
            stage, mb = instr.stage, instr.mb
            # Start once every input has arrived (an OVERLAP pair: the inputs of both ops).
            # Written out, not a helper's call per op: this loop runs 10^5-10^6 times.
            blocked, start = None, t
            for unit in (instr, order[k + 1]) if pairs and k in pairs else (instr,):
                unit_op, unit_mb = unit.op, unit.mb
                for dep_op, dep_stage in table[unit_op][unit.stage]:
                    if dep_op is None:  # the upstream backward: the same kind unless mixed
                        dep_op = (
                            unit_op
                            if fused is None
                            else upstream_backward(unit_op, dep_stage, unit_mb, fused)
                        )
                    finished = times_get((dep_op, dep_stage, unit_mb))
                    if finished is None:
                        blocked = (dep_op, dep_stage, unit_mb)
                        break
                    arrive = finished[1] + delay_r[dep_stage]
                    if arrive > start:  # noqa: PLR1730 - a compare, not a call of max()
                        start = arrive
                if blocked is not None:
                    break
            if blocked is None and moves.pending:
                gate = moves.gate(r, instr)
                if gate is not None:
                    if gate[1] is None:
                        blocked = gate[0]
                    else:
                        start = max(start, gate[1])
                        moves.consume(r, instr)
            if blocked is not None:
                waiting.setdefault(blocked, []).append(r)
                break
            node = (op, stage, mb)
            t = start + (durations[op][stage] if measured is None else measured[node])
            if charges:
                t += charges[k]
            times[node] = (start, t)
            done_order.append(node)
            slots_r.append(new(Slot, (instr, start, t)))
            if node in waiting:
                ready.extend(waiting.pop(node))
            k += 1
        pos[r], clock[r] = k, t
    stuck = [r for r in range(len(compute)) if pos[r] < len(compute[r])]
    if stuck:
        where = "; ".join(f"rank {r} at {compute[r][pos[r]]}" for r in stuck[:4])
        raise PipecError(f"the schedule cannot finish (a dependency cycle): {where}")
    return Played(times, done_order, slots)


def activation_profile(
    program: Sequence[Instr],
    layout: Layout,
    costs: CostModel,
    recompute: bool,
    stash_of_chunk: Sequence[float] | None = None,
    chunk_costs: Sequence[CostModel] | None = None,
) -> list[float]:
    """Live activation memory after each instruction of one rank's program, in stashes.

    With `stash_of_chunk` (one micro-batch's stash of each chunk, e.g. in bytes), a stage's
    stash weighs that instead of the uniform `layout.stash_share`; `chunk_costs` (one cost
    model per chunk) then gives each chunk its own memory deltas.
    """
    if stash_of_chunk is None:  # one share for every stage: a running sum, all in C
        share = layout.stash_share
        delta = {op: costs.mem_delta(op, recompute) * share for op in Op}
        return list(accumulate(map(delta.__getitem__, map(attrgetter("op"), program))))
    deltas = [
        {op: c.mem_delta(op, recompute) * weight for op in Op}
        for c, weight in zip(chunk_costs or [costs] * len(stash_of_chunk), stash_of_chunk)
    ]
    moving = {op for op in Op if costs.mem_delta(op, recompute)}
    live, out = 0.0, []
    for instr in program:
        if instr.op in moving:
            live += deltas[layout.stage_chunk[instr.stage]][instr.op]
        out.append(live)
    return out


def bytes_profile(
    program: Sequence[Instr], layout: Layout, costs: CostModel, recompute: bool
) -> list[float]:
    """`activation_profile` in bytes: F adds mem_F stashes, which weigh the chunk's measured
    stash bytes (its input bytes, with recompute, while a forward waits to be recomputed)."""
    per_stash = [b / costs.mem_F for b in costs.stash_bytes]
    by_chunk = measured_inputs(costs) if recompute else None
    return activation_profile(program, layout, costs, recompute, per_stash, by_chunk)


def measured_inputs(costs: CostModel) -> list[CostModel] | None:
    """One cost model per chunk whose `mem_input` is that chunk's measured input bytes as a
    share of its stash (a recomputed stage keeps its inputs), where the model gives them."""
    if not costs.input_bytes or not costs.stash_bytes:
        return None
    return [
        replace(costs, mem_input=costs.mem_F * i / b if b else costs.mem_input)
        for i, b in zip(costs.input_bytes, costs.stash_bytes)
    ]


def simulate(
    layout: Layout,
    programs: Sequence[Sequence[Instr]],
    costs: CostModel,
    played: Played | None = None,
    overlap_as_one: bool = False,
) -> SimResult:
    """Simulate the programs (compute orders or lowered programs) under `costs`.

    `played` reuses a `play` of the same compute orders when the programs move no stash
    (lowering keeps the orders), saving a pass. `overlap_as_one`: see the module docstring.
    """
    costs = costs.of_chunks(layout.stash_share)
    recompute = uses_recompute(programs)
    moves = Transfers(layout, costs, recompute)
    times, _, played_slots = played or play(layout, programs, costs, moves, overlap_as_one)
    synced = sync_times(layout, programs, times, costs)
    timeline, ranks = [], []
    for r, prog in enumerate(programs):
        slots = tuple(played_slots[r])
        busy = sum(s.end - s.start for s in slots)
        span = slots[-1].end - slots[0].start if slots else 0.0
        peak = max([0.0, *activation_profile(prog, layout, costs, recompute)])
        peak_bytes = None
        if costs.stash_bytes:
            peak_bytes = round(max([0.0, *bytes_profile(prog, layout, costs, recompute)]))
        sync = max(0.0, synced[r] - (slots[-1].end if slots else 0.0))
        timeline.append(slots)
        ranks.append(RankStats(busy, span, peak, layout.params_of_rank(r), sync, peak_bytes))
    makespan = max(synced + [s[-1].end for s in timeline if s], default=0.0)
    total_busy = sum(r.busy for r in ranks)
    bubble = 1 - total_busy / (len(programs) * makespan) if makespan > 0 else 0.0
    max_span = max(r.span for r in ranks)
    span_bubble = 1 - max(r.busy for r in ranks) / max_span if max_span > 0 else 0.0
    transfers = tuple(moves.records)
    return SimResult(makespan, bubble, span_bubble, tuple(ranks), tuple(timeline), transfers)
