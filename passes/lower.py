"""Lowering: insert point-to-point communication and the optimizer step into compute orders.

Every data edge between ranks becomes a message: SEND_ACT/RECV_ACT for a forward's output,
SEND_GRAD/RECV_GRAD for a backward's input gradient. The message order must agree on every
rank, or blocking point-to-point deadlocks. We key each message by its simulated send time
(ties broken by the simulator's causal completion order) and put every rank's messages in key
order; keys respect causality, so every rank can follow that one global order, and the message
with the smallest outstanding key always has both ends ready: no deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence

from passes.costs import CostModel
from passes.simulate import Played, play, uses_recompute
from pipec.ir import COMPUTE_OPS, Compiled, Instr, Op, Program, Schedule, dependencies

Node = tuple[Op, int, int]


def messages(schedule: Schedule, played: Played) -> list[tuple[Node, Node]]:
    """Every cross-rank data edge (producer, consumer), in global message order."""
    layout = schedule.layout
    times, done_order = played
    seq = {node: k for k, node in enumerate(done_order)}
    recompute = uses_recompute(schedule.orders)
    rank_of = layout.stage_rank
    edges = [
        (dep, node)
        for node in done_order
        for dep in dependencies(layout, node, recompute)
        if rank_of[dep[1]] != rank_of[node[1]]
    ]
    edges.sort(key=lambda e: (times[e[0]][1], seq[e[0]], seq[e[1]]))
    return edges


def _send_recv(producer: Node, consumer: Node, rank_of: Sequence[int]) -> tuple[Instr, Instr]:
    op, s, mb = producer
    c = consumer[1]
    if op is Op.F:
        return Instr(Op.SEND_ACT, s, mb, rank_of[c]), Instr(Op.RECV_ACT, c, mb, rank_of[s])
    return Instr(Op.SEND_GRAD, s, mb, rank_of[c]), Instr(Op.RECV_GRAD, c, mb, rank_of[s])


def lower(schedule: Schedule, costs: CostModel, played: Played | None = None) -> Compiled:
    """Insert sends, receives and OPTIMIZER_STEP; the compute order of every rank is kept.

    On each rank a send follows its producer as closely as the global message order allows,
    and a receive is placed as late as possible: right before the first compute op that needs
    it, or earlier only when a later message must wait behind it. `played` reuses a `play`
    of the schedule under `costs`.
    """
    layout = schedule.layout
    rank_of = layout.stage_rank
    per_rank: list[list[tuple[str, Instr, Node]]] = [[] for _ in schedule.orders]
    for producer, consumer in messages(schedule, played or play(layout, schedule.orders, costs)):
        send, recv = _send_recv(producer, consumer, rank_of)
        per_rank[rank_of[producer[1]]].append(("send", send, producer))
        per_rank[rank_of[consumer[1]]].append(("recv", recv, consumer))
    programs = tuple(
        _merge(order, msgs) + (Instr(Op.OPTIMIZER_STEP),)
        for order, msgs in zip(schedule.orders, per_rank)
    )
    return Compiled(schedule.name, schedule.p, schedule.m, schedule.v, layout, programs)


def _merge(order: Sequence[Instr], msgs: Sequence[tuple[str, Instr, Node]]) -> Program:
    """Interleave one rank's compute order with its messages (already in global order)."""
    index = {(i.op, i.stage, i.mb): k for k, i in enumerate(order) if i.op in COMPUTE_OPS}
    # need[k]: the last message position that compute k must wait behind (its receives).
    need = [-1] * len(order)
    for j, (kind, _, node) in enumerate(msgs):
        if kind == "recv":
            need[index[node]] = j
    out: list[Instr] = []
    ci = mi = 0
    while ci < len(order) or mi < len(msgs):
        if mi < len(msgs):
            kind, instr, node = msgs[mi]
            if (kind == "send" and index[node] < ci) or (
                kind == "recv" and (ci == len(order) or need[ci] >= mi)
            ):
                out.append(instr)
                mi += 1
                continue
        out.append(order[ci])
        ci += 1
    return tuple(out)
