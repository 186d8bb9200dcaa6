"""The zero-bubble family (Qi et al., ICLR 2024): ZB-H1, ZB-H2 and the ZB-auto heuristic."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.compile import compile_schedule
from pipec.ir import Op, PipecError
from pipec.passes.costs import CostModel, parse_costs, parse_mem
from tests.helpers import peaks, run

HALF_W = parse_mem("F=1,W=-0.5", CostModel())  # M_W = M_B / 2


def idle(result) -> list[float]:
    """Per-rank wall-time bubble: the makespan minus the rank's busy time."""
    return [result.sim.makespan - r.busy for r in result.sim.ranks]


def test_zb_h1_p4_m8_makespan():
    assert run("zb-h1", 4, 8).sim.makespan == 27  # 1F1B: 33


def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w():
    r = run("zb-h1", 8, 24, costs="F=3,B=4,W=2")
    assert idle(r) == [(8 - 1) * (3 + 4 - 2)] * 8


def test_zb_h1_memory_per_rank():
    r = compile_schedule("zb-h1", 4, 8, costs=HALF_W)
    assert peaks(r) == [4, 3.5, 3, 2.5]  # (p-r) M_B + r M_W


def test_zb_h2_warmup_depth_and_memory():
    r = compile_schedule("zb-h2", 4, 8, costs=HALF_W)
    for rank, order in enumerate(r.compiled.programs):
        ops = [i.op for i in order if i.op in (Op.F, Op.B, Op.W)]
        assert ops.index(Op.B) == 2 * (4 - rank) - 1
    # (2p-2r-1) M_B + 2r M_W (the paper's 1-based (2p-2i+1) M_B + (2i-2) M_W).
    assert peaks(r) == [7, 6, 5, 4]


@pytest.mark.parametrize("p, m", [(4, 8), (8, 15), (8, 24), (5, 9)])
def test_zb_h2_zero_bubble_with_unit_costs(p, m):
    r = run("zb-h2", p, m)
    assert r.sim.span_bubble == 0 and r.sim.makespan == 3 * m + p - 1


@pytest.mark.parametrize("costs", ["F=3,B=4,W=2", "F=5,B=4,W=3", "F=2,B=2,W=1"])
def test_zb_h2_bubble_is_p_minus_1_times_f_plus_b_minus_2w(costs):
    c = parse_costs(costs)
    r = run("zb-h2", 8, 24, costs=costs)
    spans = [s.span - s.busy for s in r.sim.ranks]
    assert max(spans) == 7 * (c.F[0] + c.B[0] - 2 * c.W[0])


# Zero Bubble Pipeline Parallelism, Table 9 (profiled F/B/W/comm, ms) and Table 5 (ZB-1P, ZB-2P).
TABLE5 = [
    # p, h, a, m, (F, B, W, comm), ZB-1P, ZB-2P
    (8, 2304, 24, 24, (18.522, 18.086, 9.337, 0.601), 0.1585, 0.0433),
    (8, 2304, 24, 32, (18.513, 18.086, 9.331, 0.626), 0.1242, 0.0039),
    (8, 2304, 24, 64, (18.546, 18.097, 9.321, 0.762), 0.0674, 0.0026),
    (8, 4096, 32, 24, (29.718, 29.444, 19.927, 0.527), 0.1323, 0.0029),
]


@pytest.mark.parametrize("p, h, a, m, ms, zb1p, zb2p", TABLE5)
def test_zb_auto_reproduces_table5(p, h, a, m, ms, zb1p, zb2p):
    f, b, w, comm = (int(x * 1000) for x in ms)  # whole microseconds, as the paper's code
    mem_f = 34 * h + 5 * a * 1024  # per layer, s = 1024; W frees 32h, B the rest
    costs = CostModel(F=(f,), B=(b,), W=(w,), comm=comm, mem_F=mem_f, mem_W=-32 * h)
    for k, expected in ((1, zb1p), (2, zb2p)):
        r = compile_schedule("zb-auto", p, m, costs=costs, memory_limit=k * p * mem_f)
        assert round(r.sim.span_bubble, 4) == expected
        assert max(peaks(r)) <= k * p * mem_f


def test_zb_auto_default_is_zb_1p_and_beats_1f1b():
    auto, onef = run("zb-auto", 4, 8), run("1f1b", 4, 8)
    assert max(peaks(auto)) <= 4 and auto.sim.makespan < onef.sim.makespan


def test_zb_auto_respects_a_tight_cap():
    r = run("zb-auto", 6, 12, memory_limit=2)
    assert max(peaks(r)) <= 2


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(2, 6),
    m=st.integers(1, 18),
    per_stage=st.lists(
        st.tuples(*[st.sampled_from([0.25, 0.5, 1, 2, 3])] * 3), min_size=6, max_size=6
    ),
    comm=st.sampled_from([0, 0.1, 1]),
    cap=st.sampled_from([1, 1.5, 2]),
)
def test_zb_auto_compiles_for_uneven_stage_costs(p, m, per_stage, comm, cap):
    """A model's per-stage costs can give a later stage a longer warm-up window than its
    predecessor; the warm-up must never run a forward whose input does not exist yet
    (it once raised KeyError). Every program compiles, verifies and stays under the cap."""
    f, b, w = [":".join(map(str, x[:p])) for x in zip(*per_stage)]
    r = run("zb-auto", p, m, costs=f"F={f},B={b},W={w},comm={comm}", memory_limit=cap * p)
    assert max(peaks(r)) <= cap * p + 1e-9


@pytest.mark.parametrize(
    "costs, limit, message",
    [
        ("F=1,B=0,W=1", None, r"--costs B must be positive \(got 0\)"),
        ("", 0.5, r"--memory-limit 0.5 is below the smallest feasible, 1 "),
    ],
)
def test_zb_auto_bad_input(costs, limit, message):
    with pytest.raises(PipecError, match=message):
        run("zb-auto", 4, 8, costs=costs, memory_limit=limit)


def test_zb_v_with_uneven_chunk_costs_keeps_1f1b_memory():
    """Per-chunk costs (a model's) can push the greedy warm-up over p stashes; zb-v then
    falls back to the order for the mean costs, which verifies and keeps p stashes."""
    r = run("zb-v", 4, 8, costs="per=chunk,F=1:2:1:1:1:1:1:3,B=2,W=1")
    assert max(peaks(r)) <= 4
