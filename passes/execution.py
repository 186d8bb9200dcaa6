"""Invariants 2 and 3, checked together: execute every program under blocking point-to-point.

A send waits for its receive, a stash move for its peer half, a replica all-reduce for both
ranks of the pair. The programs finish only if every input is produced or received before it
is used and no ranks wait on each other in a cycle: no deadlock (when there is one, the error
names the cycle: `_deadlock`). `counterpart` names the instruction
a peer must run to match a message (also used by the eviction pass's rendezvous).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipec.ir import (
    COMPUTE_OPS,
    MEMORY_OPS,
    RECV_OPS,
    SEND_OPS,
    Compiled,
    Instr,
    Layout,
    Op,
    dependency_table,
    fused_backwards,
    fused_set,
    upstream_backward,
)
from pipec.passes import replicas
from pipec.passes.simulate import uses_recompute
from pipec.passes.violation import VerifyError, at

#: Ops that meet a counterpart on a peer rank (a replica all-reduce only when it names one).
MESSAGE_LIKE = SEND_OPS | RECV_OPS | MEMORY_OPS | {Op.ALLREDUCE_GRADS}


#: The half each stash-move instruction is matched with on the peer.
_MEMORY_PAIR = {Op.EVICT: Op.ACCEPT, Op.ACCEPT: Op.EVICT, Op.LOAD: Op.RETURN, Op.RETURN: Op.LOAD}


def counterpart(instr: Instr, rank: int, compiled: Compiled) -> Instr:
    """The instruction the peer must execute to match a send, receive or stash move."""
    layout = compiled.layout
    s = instr.stage
    if instr.op in MEMORY_OPS:
        return Instr(_MEMORY_PAIR[instr.op], s, instr.mb, rank)
    if instr.op is Op.SEND_ACT:
        return Instr(Op.RECV_ACT, layout.next_stage(s), instr.mb, rank)
    if instr.op is Op.RECV_ACT:
        return Instr(Op.SEND_ACT, layout.prev_stage(s), instr.mb, rank)
    if instr.op is Op.SEND_GRAD:
        return Instr(Op.RECV_GRAD, layout.prev_stage(s), instr.mb, rank)
    return Instr(Op.SEND_GRAD, layout.next_stage(s), instr.mb, rank)


def _message_peer_error(instr: Instr, rank: int, compiled: Compiled) -> str | None:
    """Why a send/receive names the wrong peer or a stage with no such neighbour, if it does."""
    layout = compiled.layout
    s = instr.stage
    if s is None or instr.mb is None or instr.peer is None or not 0 <= s < layout.n_stages:
        return "needs a valid s=, mb= and peer"
    if instr.op in MEMORY_OPS:  # the evictor holds the stage; the acceptor is another rank
        evictor = rank if instr.op in (Op.EVICT, Op.LOAD) else instr.peer
        if not 0 <= instr.peer < compiled.world or instr.peer == rank:
            return f"the peer must be another rank of the {compiled.world}"
        if layout.stage_rank[s] != evictor:
            return f"stage {s} is on rank {layout.stage_rank[s]}, not on the evicting one {evictor}"
        return None
    downstream = instr.op in (Op.SEND_ACT, Op.RECV_GRAD)
    other = layout.next_stage(s) if downstream else layout.prev_stage(s)
    if other is None:
        return f"stage {s} has no neighbour in that direction"
    if layout.stage_rank[other] != instr.peer:
        return f"the peer stage {other} is on rank {layout.stage_rank[other]}, not {instr.peer}"
    return None


def check_execution(compiled: Compiled, training: bool = True) -> None:
    """Invariants 2 and 3: run every program with blocking point-to-point semantics.

    A rank runs until a message whose counterpart its peer has not reached; the peer, on
    reaching it, completes the pair (checking both halves) and resumes the rank. The loop runs
    once per instruction of 10^5-10^6: well-formed sends and receives take an inline path
    (tuples, no Instr built); anything else goes through `_message`, which also words errors.
    A compute op whose stage the layout lacks is refused; that each op appears once, on its
    rank, is invariant 1's part (`check_coverage`). A training program ends with its
    OPTIMIZER_STEP; an evaluation program (`training` False, passes/forward_only.py) has none.
    """
    layout, programs = compiled.layout, compiled.programs
    recompute = uses_recompute(programs)
    rank_of = layout.stage_rank
    fused = fused_set(compiled)
    n = len(programs)
    available: list[set] = [set() for _ in range(n)]  # nodes computed here or received here
    pos = [0] * n
    ready = set(range(n))
    p2p = _p2p_table(layout)
    mixed = fused_backwards(programs)  # None unless fused and split backwards mix
    table = dependency_table(layout, recompute)
    compute_ops, f_op, b_op, bw_op = COMPUTE_OPS, Op.F, Op.B, Op.BW

    while ready:
        r = ready.pop()
        prog, avail = programs[r], available[r]
        k = pos[r]
        end = len(prog)
        while k < end:
            instr = prog[k]
            op = instr.op
            if op in compute_ops:
                stage, mb = instr.stage, instr.mb
                try:
                    inputs = table[op][stage]
                except (IndexError, TypeError):  # check_coverage words this first in verify
                    raise VerifyError(f"{at(r, k, instr)}: not an op of the work graph") from None
                for dep_op, dep_stage in inputs:
                    if dep_op is None:  # the upstream backward: the same kind unless mixed
                        if mixed is not None:
                            dep_op = upstream_backward(op, dep_stage, mb, mixed)
                        else:
                            dep_op = op
                    if (dep_op, dep_stage, mb) not in avail:
                        raise _missing_input(r, k, instr, (dep_op, dep_stage, mb), rank_of)
                avail.add((op, stage, mb))
            elif op in MESSAGE_LIKE and (op is not Op.ALLREDUCE_GRADS or instr.peer is not None):
                s, mb, q = instr.stage, instr.mb, instr.peer
                entry = p2p.get(op)
                near = None if entry is None or mb is None or s is None else entry[1].get(s)
                if near is not None and rank_of[near] == q:  # a well-formed send or receive
                    counter_op, _, sends, act = entry
                    sender = s if sends else near
                    if act:
                        payload = (f_op, sender, mb)
                    else:
                        payload = (bw_op if (sender, mb) in fused else b_op, sender, mb)
                    if sends and payload not in avail:
                        pos[r] = k
                        _message(r, k, instr, compiled, available, fused)  # raises
                    delivery = (q if sends else r, payload)
                    qprog, qk = programs[q], pos[q]
                    if qk < len(qprog):
                        x = qprog[qk]
                        matched = (
                            x.op is counter_op and x.stage == near and x.mb == mb and x.peer == r
                        )
                        if matched and not sends and payload not in available[q]:
                            raise VerifyError(f"{at(q, qk, x)}: sends what is not computed yet")
                    else:
                        matched = False
                else:
                    pos[r] = k
                    check = _sync_rendezvous if op is Op.ALLREDUCE_GRADS else _message
                    other, delivery = check(r, k, instr, compiled, available, fused)
                    qprog, qk = programs[q], pos[q]
                    matched = qk < len(qprog) and qprog[qk] == other
                    if matched:  # the peer's side gets the same checks, whoever arrives first
                        check = _sync_rendezvous if op is Op.ALLREDUCE_GRADS else _message
                        check(q, qk, other, compiled, available, fused)
                if not matched:
                    break  # blocked: the peer resumes this rank when it reaches the counterpart
                if delivery:
                    available[delivery[0]].add(delivery[1])
                pos[r] = k
                pos[q] += 1
                k = pos[r]
                ready.add(q)  # the peer was blocked here (or gets here next): it goes on
            elif op is Op.OPTIMIZER_STEP and k != end - 1:
                raise VerifyError(f"{at(r, k, instr)}: OPTIMIZER_STEP must come last")
            k += 1
        pos[r] = k
    if any(pos[r] < len(programs[r]) for r in range(n)):
        raise _deadlock(compiled, pos)
    for r, prog in enumerate(programs if training else ()):
        if not prog or prog[-1].op is not Op.OPTIMIZER_STEP:
            raise VerifyError(f"rank {r}: the program must end with OPTIMIZER_STEP")


def _deadlock(compiled: Compiled, pos: Sequence[int]) -> VerifyError:
    """Why the blocked ranks never go on: the wait-for graph (an edge from each blocked rank
    to the peer whose counterpart it waits for) and its cycle, each rank with its instruction
    and what it waits for; without a cycle, the rank waiting on one that has finished.
    networkx is imported here, on the failure path only."""
    import networkx as nx

    programs = compiled.programs
    waits = nx.DiGraph()
    for r, prog in enumerate(programs):
        if pos[r] < len(prog):
            instr = prog[pos[r]]
            other = (
                replicas.counterpart(compiled.layout, instr, r)
                if instr.op is Op.ALLREDUCE_GRADS
                else counterpart(instr, r, compiled)
            )
            waits.add_edge(
                r,
                instr.peer,
                why=f"{at(r, pos[r], instr)} waits for rank {instr.peer} to reach {other}",
            )
    try:
        cycle = nx.find_cycle(waits)
    except nx.NetworkXNoCycle:
        r, q = next((r, q) for r, q in waits.edges if pos[q] == len(programs[q]))
        return VerifyError(
            f"deadlock under blocking send/recv: {waits.edges[r, q]['why']}, but rank {q} has "
            "finished its program without it"
        )
    first = min(range(len(cycle)), key=lambda k: cycle[k][0])  # read from the lowest rank
    cycle = cycle[first:] + cycle[:first]
    ranks = " -> ".join(str(r) for r, _ in cycle) + f" -> {cycle[0][0]}"
    others = waits.number_of_edges() - len(cycle)
    more = f" ({others} more blocked ranks wait on these)" if others else ""
    return VerifyError(
        f"deadlock under blocking send/recv: ranks {ranks} wait on each other in a cycle: "
        + "; ".join(waits.edges[e]["why"] for e in cycle)
        + more
    )


def _missing_input(
    r: int, pos: int, instr: Instr, dep: tuple, rank_of: Sequence[int]
) -> VerifyError:
    what = "computed" if rank_of[dep[1]] == r else f"received from rank {rank_of[dep[1]]}"
    return VerifyError(
        f"{at(r, pos, instr)}: needs {dep[0].value} s={dep[1]} mb={dep[2]}, not {what} before"
    )


def _p2p_table(layout: Layout) -> dict[Op, tuple[Op, dict[int, int], bool, bool]]:
    """Per send/receive op: the peer's op, stage -> the peer's stage, whether this end sends,
    and whether the message is an activation (else a gradient)."""
    stages = range(layout.n_stages)
    nxt = {s: t for s in stages if (t := layout.next_stage(s)) is not None}
    prv = {s: t for s in stages if (t := layout.prev_stage(s)) is not None}
    return {
        Op.SEND_ACT: (Op.RECV_ACT, nxt, True, True),
        Op.RECV_ACT: (Op.SEND_ACT, prv, False, True),
        Op.SEND_GRAD: (Op.RECV_GRAD, prv, True, False),
        Op.RECV_GRAD: (Op.SEND_GRAD, nxt, False, False),
    }


def _message(
    r: int, pos: int, instr: Instr, compiled: Compiled, available: list[set], fused: frozenset
) -> tuple[Instr, tuple[int, tuple] | None]:
    """A send, receive or stash move: the peer's counterpart, and (receiving rank, node it
    delivers); a stash move carries no work-graph value."""
    bad = _message_peer_error(instr, r, compiled)
    if bad:
        raise VerifyError(f"{at(r, pos, instr)}: {bad}")
    other = counterpart(instr, r, compiled)
    if instr.op in MEMORY_OPS:
        return other, None
    if instr.op in SEND_OPS:
        send, sender, receiver = instr, r, instr.peer
    else:
        send, sender, receiver = other, instr.peer, r
    bwd = Op.BW if (send.stage, send.mb) in fused else Op.B
    payload = (Op.F if send.op is Op.SEND_ACT else bwd, send.stage, send.mb)
    if sender == r and payload not in available[r]:
        raise VerifyError(f"{at(r, pos, instr)}: sends what is not computed yet")
    return other, (receiver, payload)


def _sync_rendezvous(
    r: int, pos: int, instr: Instr, compiled: Compiled, available: list[set], fused: frozenset
) -> tuple[Instr, None]:
    """A replica all-reduce: the peer's counterpart, once this side's gradients are final."""
    layout = compiled.layout
    bad = replicas.sync_error(layout, instr, r)
    if bad:
        raise VerifyError(f"{at(r, pos, instr)}: {bad}")
    for node in replicas.backward_nodes(layout, instr.stage, fused):
        if node not in available[r]:
            raise VerifyError(
                f"{at(r, pos, instr)}: {node[0].value} s={node[1]} mb={node[2]} has not run "
                "yet, so the gradients are not final"
            )
    return replicas.counterpart(layout, instr, r), None
