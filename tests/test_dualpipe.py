"""DualPipe and DualPipeV: DeepSeek's figures, and DualPipeV's order equals torch's."""

import pytest
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _Action, _ComputationType

from pipec.compile import CompileResult
from pipec.ir import Instr, Op
from pipec.passes.registry import Request, build_schedule
from pipec.passes.simulate import SimResult, simulate
from tests.helpers import CHUNK_UNITS, peaks, run

TORCH_OP = {
    _ComputationType.FORWARD: Op.F,
    _ComputationType.BACKWARD_INPUT: Op.B,
    _ComputationType.BACKWARD_WEIGHT: Op.W,
    _ComputationType.FULL_BACKWARD: Op.BW,
}


def torch_orders(p: int, m: int) -> list[list[Instr]]:
    """ScheduleDualPipeV's per-rank compute actions, built without a process group."""
    sched = ScheduleDualPipeV.__new__(ScheduleDualPipeV)  # __init__ needs real stages
    sched.pp_group_size, sched._n_microbatches = p, m

    def instrs(a: _Action) -> list[Instr]:
        if a.computation_type is _ComputationType.OVERLAP_F_B:
            return [Instr(Op.OVERLAP), *(x for sub in a.sub_actions for x in instrs(sub))]
        return [Instr(TORCH_OP[a.computation_type], a.stage_index, a.microbatch_index)]

    return [
        [x for a in sched._calculate_single_rank_operations(r) for x in instrs(a)] for r in range(p)
    ]


@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (4, 10), (4, 13), (8, 16), (8, 21)])
def test_dualpipev_order_equals_torch(p, m):
    ours = build_schedule("dualpipev", Request(p, m, 2)).orders
    assert [list(o) for o in ours] == torch_orders(p, m)


def deepseek(result: CompileResult) -> SimResult:
    """The programs simulated with DeepSeek's accounting: an OVERLAP pair waits for both
    inputs before either op starts (how the DualPipe paper counts its bubble)."""
    c = result.compiled
    return simulate(c.layout, c.programs, result.costs, overlap_as_one=True)


def test_dualpipe_p8_m20_deepseek_figure():
    """66 units per rank, 6 of them idle: (PP/2-1)(F&B+B-3W) with F&B=3, B=2, W=1."""
    r = run("dualpipe", 8, 20)
    sim = deepseek(r)
    assert sim.makespan == 66
    assert all(s.busy == 60 for s in sim.ranks)
    assert max(s.span for s in sim.ranks) == 66
    assert peaks(r) == [9] * 8  # PP+1 stashes
    assert [s.params for s in r.sim.ranks] == [2] * 8


def test_dualpipev_p4_m10_deepseek_figure():
    """6 idle per rank in half-chunk units; PP+1 = 9 chunk stashes of half a rank's share."""
    r = run("dualpipev", 4, 10, costs=CHUNK_UNITS)
    sim = deepseek(r)
    assert sim.makespan == 66
    assert all(sim.makespan - s.busy == 6 for s in sim.ranks)
    assert peaks(r) == [4.5] * 4
    assert [s.params for s in r.sim.ranks] == [1] * 4


@pytest.mark.parametrize("p, m", [(4, 8), (6, 12), (8, 16)])
def test_dualpipe_bubble_formula(p, m):
    """Every rank idles (PP/2-1)(F&B+B-3W) = 2(p/2-1) units at F=B=W=1, for any m >= 2p,
    in DeepSeek's accounting; run in turn (as the runtime does) a pair idles no more."""
    r = run("dualpipe", p, m)
    sim = deepseek(r)
    assert all(sim.makespan - s.busy == 2 * (p // 2 - 1) for s in sim.ranks)
    assert r.sim.makespan <= sim.makespan


@pytest.mark.parametrize("costs", [CHUNK_UNITS, "F=18.522,B=18.086,W=9.337,comm=0.601"])
@pytest.mark.parametrize("p, m", [(4, 8), (8, 24)])
def test_dualpipev_pairs_run_in_turn_like_torchs_order(p, m, costs):
    """Each op of a pair starts when its own input is there: pipec's dualpipev takes exactly
    as long as torch's ScheduleDualPipeV order run op by op (51 at p=4, m=8, unit chunk costs)."""
    r = run("dualpipev", p, m, costs=costs)
    plain = [[i for i in order if i.op is not Op.OVERLAP] for order in torch_orders(p, m)]
    theirs = simulate(r.compiled.layout, plain, r.costs)
    assert r.sim.makespan == pytest.approx(theirs.makespan, rel=1e-12)
    if (p, m, costs) == (4, 8, CHUNK_UNITS):
        assert r.sim.makespan == 51


def test_dualpipe_overlapped_pairs_are_marked():
    r = run("dualpipe", 4, 8)
    prog = r.compiled.programs[0]
    k = prog.index(Instr(Op.OVERLAP))
    pair = [i.op for i in prog[k + 1 :] if i.op in (Op.F, Op.B, Op.BW, Op.W)][:2]
    assert pair == [Op.F, Op.BW]


def test_dualpipe_syncs_replicas_at_the_end():
    prog = run("dualpipe", 4, 8).compiled.programs[1]
    assert prog[-3:] == (
        Instr(Op.ALLREDUCE_GRADS, 1, None, 2),
        Instr(Op.ALLREDUCE_GRADS, 6, None, 2),
        Instr(Op.OPTIMIZER_STEP),
    )
