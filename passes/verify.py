"""The verifier: the four invariants of DESIGN.md, checked on every program pipec emits.

1. Every op of the work graph appears exactly once, on the rank its stage is mapped to.
2. Program order respects every data dependency; an input from another rank is received first.
3. Sends and receives match one to one, and executing all programs with *blocking* point-to-
   point (a send waits for its receive) finishes: the system has no deadlock.
4. Each rank's peak live activations, counted stash by stash, equal what the simulator reports
   and stay within the user's memory limit. Stash moves (BPipe) count where the stash is: an
   EVICT frees it on the evictor, ACCEPT holds it on the acceptor until RETURN, LOAD brings it
   back; `passes/residency.py` checks that no stash is used while evicted.

Invariants 2 and 3 are checked together by executing the programs under blocking semantics
in one O(n) worklist pass. A violation is a `VerifyError` naming rank, position, instruction.
"""

from __future__ import annotations

from collections.abc import Sequence

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
)


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
    split = any(i.op in (Op.B, Op.W) for prog in programs for i in prog)
    kinds = (Op.F, Op.B, Op.W) if split else (Op.F, Op.BW)
    if uses_recompute(programs):
        kinds += (Op.RECOMPUTE,)
    expected = {
        (k, s, i) for pl in layout.pipelines for s in pl.stages for i in pl.mbs for k in kinds
    }
    seen: set = set()
    for r, prog in enumerate(programs):
        for pos, instr in enumerate(prog):
            if instr.op not in COMPUTE_OPS:
                continue
            node = (instr.op, instr.stage, instr.mb)
            if node not in expected:
                why = "mixes fused BW with split B/W" if instr.op in (Op.B, Op.W, Op.BW) else ""
                raise VerifyError(f"{_at(r, pos, instr)}: not an op of the work graph {why}".strip())
            if node in seen:
                raise VerifyError(f"{_at(r, pos, instr)}: appears more than once")
            if layout.stage_rank[instr.stage] != r:
                raise VerifyError(
                    f"{_at(r, pos, instr)}: stage {instr.stage} is mapped to rank "
                    f"{layout.stage_rank[instr.stage]}"
                )
            seen.add(node)
    missing = sorted(expected - seen, key=lambda n: (n[1], n[2], n[0].value))
    if missing:
        k, s, i = missing[0]
        raise VerifyError(
            f"rank {layout.stage_rank[s]}: {k.value} s={s} mb={i} is missing "
            f"({len(missing)} work-graph ops missing in all)"
        )


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
    """Invariants 2 and 3: run every program with blocking point-to-point semantics."""
    layout, programs = compiled.layout, compiled.programs
    recompute = uses_recompute(programs)
    rank_of = layout.stage_rank
    bwd = Op.B if any(i.op is Op.B for prog in programs for i in prog) else Op.BW
    n = len(programs)
    available: list[set] = [set() for _ in range(n)]  # nodes computed here or received here
    pos = [0] * n
    waiters: list[set[int]] = [set() for _ in range(n)]  # ranks blocked on each rank's progress
    ready = set(range(n))

    memo = layout._dependency_cache[recompute]

    def step_compute(r: int, instr: Instr) -> None:
        node = (instr.op, instr.stage, instr.mb)
        for dep in memo.get(node) or dependencies(layout, node, recompute):
            if dep not in available[r]:
                what = "computed" if rank_of[dep[1]] == r else f"received from rank {rank_of[dep[1]]}"
                raise VerifyError(
                    f"{_at(r, pos[r], instr)}: needs {dep[0].value} s={dep[1]} mb={dep[2]}, "
                    f"not {what} before"
                )
        available[r].add(node)

    while ready:
        r = ready.pop()
        prog = programs[r]
        start = pos[r]
        while pos[r] < len(prog):
            instr = prog[pos[r]]
            if instr.op in COMPUTE_OPS:
                step_compute(r, instr)
            elif instr.op in SEND_OPS or instr.op in RECV_OPS or instr.op in MEMORY_OPS:
                bad = _message_peer_error(instr, r, compiled)
                if bad:
                    raise VerifyError(f"{_at(r, pos[r], instr)}: {bad}")
                q, other = instr.peer, counterpart(instr, r, compiled)
                payload = None  # a stash move carries no work-graph value
                if instr.op not in MEMORY_OPS:
                    send, sender, receiver = (instr, r, q) if instr.op in SEND_OPS else (other, q, r)
                    payload = (Op.F if send.op is Op.SEND_ACT else bwd, send.stage, send.mb)
                    if sender == r and payload not in available[r]:
                        raise VerifyError(f"{_at(r, pos[r], instr)}: sends what is not computed yet")
                if pos[q] >= len(programs[q]) or programs[q][pos[q]] != other:
                    waiters[q].add(r)  # blocked until the peer reaches the counterpart
                    break
                if payload is not None:
                    available[receiver].add(payload)
                pos[q] += 1
                ready.add(q)
                ready |= waiters[q]  # the peer moved: whoever waits on it may go on
                waiters[q].clear()
            elif instr.op is Op.OPTIMIZER_STEP:
                if pos[r] != len(prog) - 1:
                    raise VerifyError(f"{_at(r, pos[r], instr)}: OPTIMIZER_STEP must come last")
            pos[r] += 1
        if pos[r] != start:  # wake waiters only on progress, or a deadlock would spin
            ready |= waiters[r]
            waiters[r].clear()
    stuck = [r for r in range(n) if pos[r] < len(programs[r])]
    if stuck:
        where = "; ".join(f"{_at(r, pos[r], programs[r][pos[r]])} waits" for r in stuck[:4])
        raise VerifyError(f"deadlock under blocking send/recv: {where}")
    for r, prog in enumerate(programs):
        if not prog or prog[-1].op is not Op.OPTIMIZER_STEP:
            raise VerifyError(f"rank {r}: the program must end with OPTIMIZER_STEP")


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
    for r, prog in enumerate(compiled.programs):
        stash: dict[tuple[int, int], float] = {}
        live = peak = 0.0
        for pos, instr in enumerate(prog):
            key = (instr.stage, instr.mb)
            if instr.op is Op.F:
                new = (costs.mem_input if recompute else costs.mem_F) * share
            elif instr.op is Op.RECOMPUTE:
                new = costs.mem_F * share
            elif instr.op is Op.B:
                new = -costs.mem_W * share  # what W still needs after the input gradient
            elif instr.op in (Op.W, Op.BW, Op.EVICT, Op.RETURN):
                new = 0.0
            elif instr.op in (Op.LOAD, Op.ACCEPT):  # the stash as F left it, here again
                new = costs.stash_size(recompute) * share
            else:
                continue
            live += new - stash.get(key, 0.0)
            stash[key] = new
            peak = max(peak, live)
            if memory_limit is not None and live > memory_limit + 1e-9:
                raise VerifyError(
                    f"{_at(r, pos, instr)}: {live:g} stashes live, over the limit {memory_limit:g}"
                )
        if peaks is not None and abs(peaks[r] - peak) > 1e-6:
            raise VerifyError(
                f"rank {r}: counted peak {peak:g} stashes, the simulator reports {peaks[r]:g}"
            )

