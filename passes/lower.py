"""Lowering: insert point-to-point communication and the optimizer step into compute orders.

Every data edge between ranks becomes a message: SEND_ACT/RECV_ACT for a forward's output,
SEND_GRAD/RECV_GRAD for a backward's input gradient. The message order must agree on every
rank, or blocking point-to-point deadlocks. We key each message by its simulated send time
(ties broken by the simulator's causal completion order) and put every rank's messages in key
order; keys respect causality, so every rank can follow that one global order, and the message
with the smallest outstanding key always has both ends ready: no deadlock.

A replica all-reduce (ALLREDUCE_GRADS in a schedule's order) joins the same global order as a
two-ended message keyed by the later of its two triggers (the compute op before it on each
rank), so both ranks of a pair issue their collectives in one order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from operator import itemgetter

from pipec.ir import (
    COMPUTE_OPS,
    Compiled,
    Instr,
    Layout,
    Op,
    PipecError,
    Program,
    Schedule,
    dependencies,
    fused_backwards,
)
from pipec.passes.costs import CostModel
from pipec.passes.simulate import Played, play, uses_recompute

Node = tuple[Op, int, int]
Entry = tuple[tuple, str, Instr, Node | None]
"""One rank's part in a message: (the message's global key, "send" | "recv" | "sync",
instruction, compute node it follows (send, sync) or precedes (recv); None for a sync with
no compute before it)."""

#: (send, receive) ops of a message carrying a forward's output (True) or a gradient (False).
_MESSAGE_OPS = {True: (Op.SEND_ACT, Op.RECV_ACT), False: (Op.SEND_GRAD, Op.RECV_GRAD)}


def messages(schedule: Schedule, played: Played) -> list[list[Entry]]:
    """Each rank's part in every cross-rank data edge and replica all-reduce, in global
    message order (sorted rank by rank: the order of a rank's entries is all it needs)."""
    layout = schedule.layout
    times, done_order, _ = played
    # A data message's key: its producer's (end, completion position). The sort is stable and
    # messages are made in the consumers' completion order, which breaks the remaining ties.
    position = dict(zip(done_order, range(len(done_order))))
    recompute = uses_recompute(schedule.orders)
    fused = fused_backwards(schedule.orders)
    rank_of = layout.stage_rank
    crossing = _crossing_deps(layout, recompute, fused)
    per_rank: list[list[Entry]] = [[] for _ in schedule.orders]
    for node in done_order:
        _, s, i = node
        here = rank_of[s]
        for dep_op, dep_stage, there, send_op, recv_op in crossing(node):
            dep = (dep_op, dep_stage, i)
            key = (times[dep][1], position[dep])
            per_rank[there].append((key, "send", Instr(send_op, dep_stage, i, here), dep))
            per_rank[here].append((key, "recv", Instr(recv_op, s, i, there), node))
    triggers = _sync_triggers(schedule)
    for s, (instr, trigger) in triggers.items():
        r = layout.replica[s]
        if r not in triggers:
            raise PipecError(
                f"{schedule.name}: stage {s} all-reduces with stage {r}, which does not"
            )
        if s < r:
            other, other_trigger = triggers[r]
            late = max(
                (times[t][1], position[t]) if t else (0.0, -1) for t in (trigger, other_trigger)
            )
            # After every data message of the same trigger; the chunk breaks ties between pairs.
            key = (*late, len(position) + layout.stage_chunk[s])
            per_rank[rank_of[s]].append((key, "sync", instr, trigger))
            per_rank[rank_of[r]].append((key, "sync", other, other_trigger))
    for entries in per_rank:
        entries.sort(key=_by_key)
    return per_rank


_by_key = itemgetter(0)


Crossing = tuple[tuple[Op, int, int, Op, Op], ...]
"""A node's inputs from other ranks: (producer op, producer stage, producer's rank, send op,
receive op); the producer works on the node's micro-batch."""


def _crossing_deps(
    layout: Layout, recompute: bool, fused: frozenset[tuple[int, int]] | None
) -> Callable[[Node], Crossing]:
    """node -> its inputs from other ranks, kept per (op, stage) where the micro-batch does
    not change them (no mix of fused and split backwards): 10^5 nodes, a few hundred kinds."""
    rank_of = layout.stage_rank
    memo: dict[tuple, Crossing] = {}

    def crossing(node: Node) -> Crossing:
        key = node[:2] if fused is None else node
        found = memo.get(key)
        if found is None:
            here = rank_of[node[1]]
            found = memo[key] = tuple(
                (dep[0], dep[1], rank_of[dep[1]], *_MESSAGE_OPS[dep[0] is Op.F])
                for dep in dependencies(layout, node, recompute, fused)
                if rank_of[dep[1]] != here  # a forward's output goes downstream, else a gradient
            )
        return found

    return crossing


def _sync_triggers(schedule: Schedule) -> dict[int, tuple[Instr, Node | None]]:
    """stage -> (its ALLREDUCE_GRADS, the compute op before it in its rank's order)."""
    found = {}
    for order in schedule.orders:
        last = None
        for instr in order:
            if instr.op in COMPUTE_OPS:
                last = (instr.op, instr.stage, instr.mb)
            elif instr.op is Op.ALLREDUCE_GRADS:
                found[instr.stage] = (instr, last)
    return found


def lower(schedule: Schedule, costs: CostModel, played: Played | None = None) -> Compiled:
    """Insert sends, receives and OPTIMIZER_STEP; the compute order of every rank is kept.

    On each rank a send follows its producer as closely as the global message order allows,
    and a receive is placed as late as possible: right before the first compute op that needs
    it, or earlier only when a later message must wait behind it (a send or sync follows it in
    the global order). `played` reuses a `play` of the schedule under `costs`.
    """
    per_rank = messages(schedule, played or play(schedule.layout, schedule.orders, costs))
    programs = tuple(
        _merge([i for i in order if i.op is not Op.ALLREDUCE_GRADS], msgs)
        + (Instr(Op.OPTIMIZER_STEP),)
        for order, msgs in zip(schedule.orders, per_rank)
    )
    return Compiled(schedule.name, schedule.p, schedule.m, schedule.v, schedule.layout, programs)


def _merge(order: Sequence[Instr], msgs: Sequence[Entry]) -> Program:
    """Interleave one rank's compute order with its messages (already in global order)."""
    index: dict[Node | None, int] = {None: -1}  # a sync with no compute before it: at once
    index.update(((i.op, i.stage, i.mb), k) for k, i in enumerate(order) if i.op in COMPUTE_OPS)
    # need[k]: the last message position that compute k must wait behind (its receives).
    need = [-1] * len(order)
    for j, (_, kind, _, node) in enumerate(msgs):
        if kind == "recv":
            need[index[node]] = j
    # An OVERLAP pair: the receives of both its ops are posted before the marker, so that a
    # runtime overlapping the two has both inputs on the way (each op waits for its own).
    overlaps = [k for k, instr in enumerate(order) if instr.op is Op.OVERLAP]
    computes = sorted(index.values())[1:] if overlaps else []  # without the None entry's -1
    for k in overlaps:
        first = bisect_right(computes, k)
        need[k] = max(need[j] for j in computes[first : first + 2])
    # Each message goes out as soon as it may: a send or sync once the compute op it follows
    # is out; a receive as late as it may: before the first compute op that waits behind it,
    # or before the next send or sync in the global order, whichever comes first. Placed at
    # its consumer instead, a receive would hold back every send after it in the order: the
    # peer waiting on that send would wait for compute it does not depend on.
    # before[j]: how many compute ops precede message j (non-decreasing in j). Forward: a send
    # or sync after its compute op and every earlier send; a receive before the first compute
    # op waiting behind it or a later message. Backward: a receive no later than the message
    # after it.
    n, before = len(order), [len(order)] * len(msgs)
    last, k, peak = 0, 0, need[0] if order else -1
    for j, (_, kind, _, node) in enumerate(msgs):
        if kind != "recv":
            last = before[j] = max(last, index[node] + 1)
            continue
        while peak < j and k + 1 < n:
            k += 1
            peak = max(peak, need[k])
        if peak >= j:
            before[j] = k
    bound = n
    for j in range(len(msgs) - 1, -1, -1):
        if msgs[j][1] == "recv":
            before[j] = min(before[j], bound)
        bound = before[j]
    out: list[Instr] = []
    ci = 0
    for j, entry in enumerate(msgs):
        if before[j] > ci:
            out += order[ci : before[j]]
            ci = before[j]
        out.append(entry[2])
    out += order[ci:]
    return tuple(out)
