"""Gradient synchronisation between the two replicas of a model chunk.

Bidirectional schedules (Chimera, BitPipe, DualPipe) hold two replicas of the model: a chunk is
computed by two stages on two ranks, and before the optimizer step their gradients must be
summed with `ALLREDUCE_GRADS s=<stage> to=<rank of the replica>` on both ranks. A schedule
places the instruction where the collective may be issued: after the rank's last compute op
(Chimera, DualPipe) or right after the chunk's last backward (BitPipe's eager sync). Lowering
then puts every pair's collectives in one global order on both ranks; this module holds what
the schedules, the verifier and the simulator share about them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pipec.ir import COMPUTE_OPS, Instr, Layout, Op, PipecError, op_kinds
from pipec.passes.costs import CostModel

Node = tuple[Op, int, int]


def sync_instr(layout: Layout, stage: int) -> Instr:
    """The all-reduce of `stage`'s gradients with its replica's rank."""
    return Instr(Op.ALLREDUCE_GRADS, stage, None, layout.stage_rank[layout.replica[stage]])


def counterpart(layout: Layout, instr: Instr, rank: int) -> Instr:
    """The instruction the peer executes to take part in the same all-reduce."""
    return Instr(Op.ALLREDUCE_GRADS, layout.replica[instr.stage], None, rank)


def syncs_at_end(
    layout: Layout, orders: Sequence[Sequence[Instr]]
) -> tuple[tuple[Instr, ...], ...]:
    """Append each rank's all-reduces after its last compute op, by chunk (Chimera's sync)."""
    return tuple(
        tuple(order)
        + tuple(
            sync_instr(layout, s)
            for s in sorted(layout.stages_of_rank(r), key=lambda s: layout.stage_chunk[s])
            if s in layout.replica
        )
        for r, order in enumerate(orders)
    )


def eager_syncs(layout: Layout, orders: Sequence[Sequence[Instr]]) -> tuple[tuple[Instr, ...], ...]:
    """Insert each stage's all-reduce right after its last backward op (BitPipe's eager sync)."""
    out = []
    for order in orders:
        last = {i.stage: k for k, i in enumerate(order) if i.op in (Op.B, Op.W, Op.BW)}
        after = {k: s for s, k in last.items() if s in layout.replica}
        prog: list[Instr] = []
        for k, instr in enumerate(order):
            prog.append(instr)
            if k in after:
                prog.append(sync_instr(layout, after[k]))
        out.append(tuple(prog))
    return tuple(out)


def backward_nodes(layout: Layout, stage: int, fused: Collection[tuple[int, int]]) -> list[Node]:
    """Every backward op of `stage` (BW where (stage, mb) is in `fused`, else B and W): the
    gradients are final once all of them have run."""
    mbs = layout.pipelines[layout.pipeline_of_stage(stage)].mbs
    return [(k, stage, i) for i in mbs for k in ((Op.BW,) if (stage, i) in fused else (Op.B, Op.W))]


def sync_error(layout: Layout, instr: Instr, rank: int) -> str | None:
    """Why an ALLREDUCE_GRADS names a stage or peer that does not fit the layout, if it does."""
    s = instr.stage
    if s is None or instr.peer is None or not 0 <= s < layout.n_stages or instr.mb is not None:
        return "needs a valid s= and to= (and no mb=)"
    if layout.stage_rank[s] != rank:
        return f"stage {s} is mapped to rank {layout.stage_rank[s]}"
    if s not in layout.replica:
        return f"stage {s} has no replica to synchronise with"
    peer = layout.stage_rank[layout.replica[s]]
    if instr.peer != peer:
        return f"the replica of stage {s} (stage {layout.replica[s]}) is on rank {peer}"
    return None


def coverage_error(layout: Layout, programs: Sequence[Sequence[Instr]]) -> str | None:
    """Why the programs do not all-reduce every replicated stage exactly once, if they do not."""
    seen: set[int] = set()
    synced = Op.ALLREDUCE_GRADS in op_kinds(programs)  # most schedules have none to walk
    for r, prog in enumerate(programs if synced else ()):
        for pos, instr in enumerate(prog):
            if instr.op is not Op.ALLREDUCE_GRADS or instr.peer is None:  # DP's: no replica
                continue
            bad = sync_error(layout, instr, r)
            if bad:
                return f"rank {r}, instruction {pos} ({instr}): {bad}"
            if instr.stage in seen:
                return f"rank {r}, instruction {pos} ({instr}): appears more than once"
            seen.add(instr.stage)
    missing = sorted(set(layout.replica) - seen)
    if missing:
        s = missing[0]
        return (
            f"rank {layout.stage_rank[s]}: stage {s} has a replica on rank "
            f"{layout.stage_rank[layout.replica[s]]} but no ALLREDUCE_GRADS"
        )
    return None


def sync_times(
    layout: Layout,
    programs: Sequence[Sequence[Instr]],
    times: dict[Node, tuple[float, float]],
    costs: CostModel,
) -> list[float]:
    """Per rank, when its last all-reduce ends (0 without any), under `costs.allreduce`.

    A rank issues an all-reduce when it reaches the instruction (its previous compute op has
    ended) and goes on computing: the collective overlaps later compute. It starts once both
    ranks have issued it and each rank's previous collective has finished (one communicator
    per rank runs them in turn), and takes `costs.allreduce`.
    """
    if Op.ALLREDUCE_GRADS not in op_kinds(programs):  # most schedules
        return [0.0] * len(programs)
    pending: list[list[tuple[Instr, float]]] = []
    for prog in programs:
        clock, mine = 0.0, []
        for instr in prog:
            if instr.op in COMPUTE_OPS:
                clock = times[(instr.op, instr.stage, instr.mb)][1]
            elif instr.op is Op.ALLREDUCE_GRADS and instr.peer is not None:  # not DP's
                mine.append((instr, clock))
        pending.append(mine)
    head = [0] * len(programs)
    done = [0.0] * len(programs)
    progress = True
    while progress:
        progress = False
        for r, mine in enumerate(pending):
            if head[r] == len(mine):
                continue
            instr, issued = mine[head[r]]
            q = instr.peer
            if head[q] < len(pending[q]) and pending[q][head[q]][0] == counterpart(
                layout, instr, r
            ):
                start = max(issued, pending[q][head[q]][1], done[r], done[q])
                done[r] = done[q] = start + costs.allreduce
                head[r] += 1
                head[q] += 1
                progress = True
    stuck = [r for r, mine in enumerate(pending) if head[r] < len(mine)]
    if stuck:
        r = stuck[0]
        raise PipecError(
            f"rank {r}: {pending[r][head[r]][0]} has no matching all-reduce on its peer at the "
            "same point of the pair's order"
        )
    return done
