"""The verifier: the four invariants of docs/design.md, checked on every program pipec emits.

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

Invariants 2 and 3 are checked together by executing the programs under blocking semantics in
one O(n) worklist pass (`passes/execution.py`). A violation is a `VerifyError` naming rank,
position, instruction; a deadlock names the whole cycle of ranks that wait on each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import attrgetter

from pipec.ir import COMPUTE_OPS, Compiled, Instr, Op, fused_set, op_kinds
from pipec.passes import replicas
from pipec.passes.costs import CostModel
from pipec.passes.data_parallel import dp_sync_error
from pipec.passes.execution import check_execution
from pipec.passes.residency import check_residency
from pipec.passes.simulate import uses_recompute
from pipec.passes.violation import VerifyError, at

__all__ = [
    "VerifyError",
    "check_coverage",
    "check_execution",
    "check_memory",
    "verify",
]


_op_of = attrgetter("op")


def verify(
    compiled: Compiled,
    costs: CostModel,
    peaks: Sequence[float] | None = None,
    memory_limit: float | None = None,
    execution: bool = True,
    dp: int = 1,
) -> None:
    """Raise VerifyError unless `compiled` satisfies all four invariants.

    `peaks` are the simulator's per-rank peak activations to check against; `memory_limit`
    (in stashes) is the user's cap. `execution=False` leaves invariants 2-3 to the caller:
    the compile driver runs `check_execution`, the longest check, beside the simulation.
    `dp` copies of the pipeline need each stage's gradients all-reduced once (invariant 1).
    """
    check_coverage(compiled, dp)
    if execution:
        check_execution(compiled)
    check_residency(compiled)
    check_memory(compiled, costs, peaks, memory_limit)


def check_coverage(compiled: Compiled, dp: int = 1) -> None:
    """Invariant 1: each work-graph op exactly once, on its stage's rank; each replica and
    data-parallel gradient sync exactly once."""
    layout, programs = compiled.layout, compiled.programs
    if len(programs) != layout.p:
        raise VerifyError(f"{len(programs)} programs for a {layout.p}-rank layout")
    fused = fused_set(compiled)
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
    bad = (
        replicas.coverage_error(layout, programs)
        or dp_sync_error(programs, dp)
        or _overlap_error(programs)
    )
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
            raise VerifyError(f"{at(r, pos, instr)}: not an op of the work graph {why}".strip())
        if node in seen:
            raise VerifyError(f"{at(r, pos, instr)}: appears more than once")
        if rank_of[instr.stage] != r:
            raise VerifyError(
                f"{at(r, pos, instr)}: stage {instr.stage} is mapped to rank {rank_of[instr.stage]}"
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
                    return f"{at(r, marker, prog[marker])}: {why}"
                marker, pair = pos, []
            elif marker is not None and instr.op in COMPUTE_OPS:
                pair.append(instr.op)
                if len(pair) == 2:
                    if pair not in ([Op.F, Op.B], [Op.F, Op.BW]):
                        return f"{at(r, marker, prog[marker])}: {why}"
                    marker = None
        if marker is not None:
            return f"{at(r, marker, prog[marker])}: {why}"
    return None


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
                    f"{at(r, pos, instr)}: {live:g} stashes live, over the limit {memory_limit:g}"
                )
        if peaks is not None and abs(peaks[r] - peak) > 1e-6:
            raise VerifyError(
                f"rank {r}: counted peak {peak:g} stashes, the simulator reports {peaks[r]:g}"
            )
