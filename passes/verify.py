"""The verifier: the four invariants of DESIGN.md, checked on every program pipec emits.

1. Every op of the work graph appears exactly once, on the rank its stage is mapped to.
2. Program order respects every data dependency; an input from another rank is received first.
3. Sends and receives match one to one, and executing all programs with *blocking* point-to-
   point (a send waits for its receive) finishes: the system has no deadlock. The same holds
   for replica all-reduces (ALLREDUCE_GRADS): each replicated stage has exactly one, both
   ranks of the pair meet at it (a blocking rendezvous), and each side has finished all of
   that stage's backward work by then.
4. Each rank's peak live activations, counted stash by stash, equal what the simulator reports
   and stay within the user's memory limit. Stash moves (BPipe) count where the stash is: an
   EVICT frees it on the evictor, ACCEPT holds it on the acceptor until RETURN, LOAD brings it
   back; `passes/residency.py` checks that no stash is used while evicted.

Invariants 2 and 3 are checked together by executing the programs under blocking semantics
in one O(n) worklist pass. A violation is a `VerifyError` naming rank, position, instruction.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import attrgetter

from passes import replicas
from passes.costs import CostModel
from passes.residency import check_residency
from passes.simulate import uses_recompute
from pipec.ir import (
    COMPUTE_OPS,
    MEMORY_OPS,
    RECV_OPS,
    SEND_OPS,
    Compiled,
    Instr,
    Op,
    PipecError,
    dependencies,
    Layout,
    dependency_memo,
    fused_backwards,
    op_kinds,
)


#: Ops that meet a counterpart on a peer rank (a replica all-reduce only when it names one).
MESSAGE_LIKE = SEND_OPS | RECV_OPS | MEMORY_OPS | {Op.ALLREDUCE_GRADS}


_op_of = attrgetter("op")


class VerifyError(PipecError):
    """A program breaks one of the invariants; the message says where and why."""


def _at(rank: int, pos: int, instr: Instr) -> str:
    return f"rank {rank}, instruction {pos} ({instr})"


def verify(
    compiled: Compiled,
    costs: CostModel,
    peaks: Sequence[float] | None = None,
    memory_limit: float | None = None,
) -> None:
    """Raise VerifyError unless `compiled` satisfies all four invariants.

    `peaks` are the simulator's per-rank peak activations to check against; `memory_limit`
    (in stashes) is the user's cap.
    """
    check_coverage(compiled)
    check_execution(compiled)
    check_residency(compiled)
    check_memory(compiled, costs, peaks, memory_limit)


def check_coverage(compiled: Compiled) -> None:
    """Invariant 1: each work-graph op exactly once, on its stage's rank."""
    layout, programs = compiled.layout, compiled.programs
    if len(programs) != layout.p:
        raise VerifyError(f"{len(programs)} programs for a {layout.p}-rank layout")
    fused = _fused(compiled)
    extra = (Op.RECOMPUTE,) if uses_recompute(programs) else ()
    fused_kinds, split_kinds = (Op.F, *extra, Op.BW), (Op.F, *extra, Op.B, Op.W)
    expected = {
        (k, s, i)
        for pl in layout.pipelines
        for s in pl.stages
        for i in pl.mbs
        for k in (fused_kinds if (s, i) in fused else split_kinds)
    }
    seen: set = set()
    rank_of = layout.stage_rank
    for r, prog in enumerate(programs):
        nodes = [(i.op, i.stage, i.mb) for i in prog if i.op in COMPUTE_OPS]  # set ops in C:
        mine = set(nodes)  # the instruction-by-instruction walk runs only to word an error
        if (
            len(mine) != len(nodes)
            or not mine <= expected
            or not seen.isdisjoint(mine)
            or any(rank_of[s] != r for s in {n[1] for n in mine})
        ):
            _raise_coverage_error(r, prog, expected, seen, rank_of)
        seen |= mine
    missing = sorted(expected - seen, key=lambda n: (n[1], n[2], n[0].value))
    if missing:
        k, s, i = missing[0]
        raise VerifyError(
            f"rank {layout.stage_rank[s]}: {k.value} s={s} mb={i} is missing "
            f"({len(missing)} work-graph ops missing in all)"
        )
    bad = replicas.coverage_error(layout, programs) or _overlap_error(programs)
    if bad:
        raise VerifyError(bad)


def _raise_coverage_error(
    r: int, prog: Sequence[Instr], expected: set, seen: set, rank_of: Sequence[int]
) -> None:
    """Raise the VerifyError for the first compute op of rank r that breaks invariant 1."""
    seen = set(seen)
    for pos, instr in enumerate(prog):
        if instr.op not in COMPUTE_OPS:
            continue
        node = (instr.op, instr.stage, instr.mb)
        if node not in expected:
            why = "mixes fused BW with split B/W" if instr.op in (Op.B, Op.W, Op.BW) else ""
            raise VerifyError(f"{_at(r, pos, instr)}: not an op of the work graph {why}".strip())
        if node in seen:
            raise VerifyError(f"{_at(r, pos, instr)}: appears more than once")
        if rank_of[instr.stage] != r:
            raise VerifyError(
                f"{_at(r, pos, instr)}: stage {instr.stage} is mapped to rank {rank_of[instr.stage]}"
            )
        seen.add(node)


def _overlap_error(programs: Sequence[Sequence[Instr]]) -> str | None:
    """Why an OVERLAP marker is not followed by a forward and then a backward, if one is not."""
    why = "must precede a forward and then a backward"
    if Op.OVERLAP not in op_kinds(programs):  # the common case
        return None
    for r, prog in enumerate(programs):
        marker, pair = None, []
        for pos, instr in enumerate(prog):
            if instr.op is Op.OVERLAP:
                if marker is not None:
                    return f"{_at(r, marker, prog[marker])}: {why}"
                marker, pair = pos, []
            elif marker is not None and instr.op in COMPUTE_OPS:
                pair.append(instr.op)
                if len(pair) == 2:
                    if pair not in ([Op.F, Op.B], [Op.F, Op.BW]):
                        return f"{_at(r, marker, prog[marker])}: {why}"
                    marker = None
        if marker is not None:
            return f"{_at(r, marker, prog[marker])}: {why}"
    return None


def _fused(compiled: Compiled) -> frozenset[tuple[int, int]]:
    """(stage, mb) whose backward is one fused BW: all, none, or DualPipe's mix."""
    programs = compiled.programs
    mixed = fused_backwards(programs)
    if mixed is not None:
        return mixed
    kinds = op_kinds(programs)
    if Op.B in kinds or Op.W in kinds:
        return frozenset()
    layout = compiled.layout
    return frozenset((s, i) for pl in layout.pipelines for s in pl.stages for i in pl.mbs)


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
    other = layout.next_stage(s) if instr.op in (Op.SEND_ACT, Op.RECV_GRAD) else layout.prev_stage(s)
    if other is None:
        return f"stage {s} has no neighbour in that direction"
    if layout.stage_rank[other] != instr.peer:
        return f"the peer stage {other} is on rank {layout.stage_rank[other]}, not {instr.peer}"
    return None


def check_execution(compiled: Compiled) -> None:
    """Invariants 2 and 3: run every program with blocking point-to-point semantics.

    A rank runs until a message whose counterpart its peer has not reached; the peer, on
    reaching it, completes the pair (checking both halves) and resumes the rank. The loop runs
    once per instruction of 10^5-10^6: well-formed sends and receives take an inline path
    (tuples, no Instr built); anything else goes through `_message`, which also words errors.
    """
    layout, programs = compiled.layout, compiled.programs
    recompute = uses_recompute(programs)
    rank_of = layout.stage_rank
    fused = _fused(compiled)
    n = len(programs)
    available: list[set] = [set() for _ in range(n)]  # nodes computed here or received here
    pos = [0] * n
    ready = set(range(n))
    p2p = _p2p_table(layout)
    mixed = fused_backwards(programs)  # None unless fused and split backwards mix
    memo = dependency_memo(layout, recompute, mixed)
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
                node = (op, instr.stage, instr.mb)
                for dep in memo.get(node) or dependencies(layout, node, recompute, mixed):
                    if dep not in avail:
                        raise _missing_input(r, k, instr, dep, rank_of)
                avail.add(node)
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
                            raise VerifyError(f"{_at(q, qk, x)}: sends what is not computed yet")
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
            elif op is Op.OPTIMIZER_STEP:
                if k != end - 1:
                    raise VerifyError(f"{_at(r, k, instr)}: OPTIMIZER_STEP must come last")
            k += 1
        pos[r] = k
    stuck = [r for r in range(n) if pos[r] < len(programs[r])]
    if stuck:
        where = "; ".join(f"{_at(r, pos[r], programs[r][pos[r]])} waits" for r in stuck[:4])
        raise VerifyError(f"deadlock under blocking send/recv: {where}")
    for r, prog in enumerate(programs):
        if not prog or prog[-1].op is not Op.OPTIMIZER_STEP:
            raise VerifyError(f"rank {r}: the program must end with OPTIMIZER_STEP")


def _missing_input(
    r: int, pos: int, instr: Instr, dep: tuple, rank_of: Sequence[int]
) -> VerifyError:
    what = "computed" if rank_of[dep[1]] == r else f"received from rank {rank_of[dep[1]]}"
    return VerifyError(
        f"{_at(r, pos, instr)}: needs {dep[0].value} s={dep[1]} mb={dep[2]}, not {what} before"
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
        raise VerifyError(f"{_at(r, pos, instr)}: {bad}")
    other = counterpart(instr, r, compiled)
    if instr.op in MEMORY_OPS:
        return other, None
    send, sender, receiver = (instr, r, instr.peer) if instr.op in SEND_OPS else (other, instr.peer, r)
    bwd = Op.BW if (send.stage, send.mb) in fused else Op.B
    payload = (Op.F if send.op is Op.SEND_ACT else bwd, send.stage, send.mb)
    if sender == r and payload not in available[r]:
        raise VerifyError(f"{_at(r, pos, instr)}: sends what is not computed yet")
    return other, (receiver, payload)


def _sync_rendezvous(
    r: int, pos: int, instr: Instr, compiled: Compiled, available: list[set], fused: frozenset
) -> tuple[Instr, None]:
    """A replica all-reduce: the peer's counterpart, once this side's gradients are final."""
    layout = compiled.layout
    bad = replicas.sync_error(layout, instr, r)
    if bad:
        raise VerifyError(f"{_at(r, pos, instr)}: {bad}")
    for node in replicas.backward_nodes(layout, instr.stage, fused):
        if node not in available[r]:
            raise VerifyError(
                f"{_at(r, pos, instr)}: {node[0].value} s={node[1]} mb={node[2]} has not run "
                "yet, so the gradients are not final"
            )
    return replicas.counterpart(layout, instr, r), None


def check_memory(
    compiled: Compiled,
    costs: CostModel,
    peaks: Sequence[float] | None,
    memory_limit: float | None,
) -> None:
    """Invariant 4: count live stashes op by op; compare with the simulator and the limit."""
    layout = compiled.layout
    recompute = uses_recompute(compiled.programs)
    share = layout.stash_share
    stash_size = costs.stash_size(recompute) * share  # LOAD, ACCEPT: the stash as F left it
    stash_of = {  # what each op leaves of its (stage, mb)'s stash; other ops leave it alone
        Op.F: (costs.mem_input if recompute else costs.mem_F) * share,
        Op.RECOMPUTE: costs.mem_F * share,
        Op.B: -costs.mem_W * share,  # what W still needs after the input gradient
        Op.W: 0.0,
        Op.BW: 0.0,
        Op.EVICT: 0.0,
        Op.RETURN: 0.0,
        Op.LOAD: stash_size,
        Op.ACCEPT: stash_size,
    }
    limit = None if memory_limit is None else memory_limit + 1e-9
    counted = stash_of.keys().__contains__
    for r, prog in enumerate(compiled.programs):
        stash: dict[tuple[int, int], float] = {}
        live = peak = 0.0
        # Messages (most instructions) leave stashes alone: they are filtered out in C.
        for pos, instr in compress(enumerate(prog), map(counted, map(_op_of, prog))):
            new = stash_of[instr.op]
            key = (instr.stage, instr.mb)
            live += new - stash.get(key, 0.0)
            stash[key] = new
            peak = max(peak, live)
            if limit is not None and live > limit:
                raise VerifyError(
                    f"{_at(r, pos, instr)}: {live:g} stashes live, over the limit {memory_limit:g}"
                )
        if peaks is not None and abs(peaks[r] - peak) > 1e-6:
            raise VerifyError(
                f"rank {r}: counted peak {peak:g} stashes, the simulator reports {peaks[r]:g}"
            )

