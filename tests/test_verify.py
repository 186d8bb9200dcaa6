"""The verifier: every emitted program verifies, and each invariant catches a broken program."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipec.ir import Instr, Op, PipecError
from pipec.passes.costs import CostModel
from pipec.passes.registry import SCHEDULES, family
from pipec.passes.verify import VerifyError, verify
from tests.helpers import peaks, run

family("1f1b")  # registers the built-in families
# v-adaptive searches building blocks (seconds per draw at p = 16): tests/test_v_adaptive.py
# runs the same property on a smaller grid of its own.
GRID = sorted(set(SCHEDULES) - {"v-adaptive"})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
@pytest.mark.parametrize("name", GRID)
def test_every_emitted_program_verifies(name, data):
    fam = SCHEDULES[name]
    p = data.draw(st.integers(1, 16), label="p")
    m = data.draw(st.integers(1, 64), label="m")
    if data.draw(st.booleans(), label="m multiple of p"):
        m = min(64 - 64 % p, max(p, m - m % p))
    v = data.draw(st.sampled_from(sorted({fam.default_v, fam.default_v + 1})), label="v")
    try:
        result = run(name, p, m, v)  # compile_schedule verifies; a violation raises
    except PipecError as e:
        assert "VerifyError" not in type(e).__name__
        assume(False)
    verify(result.compiled, result.costs, peaks(result))


def _broken(result, rank, new_program):
    programs = list(result.compiled.programs)
    programs[rank] = tuple(new_program)
    return replace(result.compiled, programs=tuple(programs))


@pytest.fixture
def base():
    return run("1f1b", 4, 8)


def test_invariant1_missing_op(base):
    prog = [i for i in base.compiled.programs[1] if i != Instr(Op.F, 1, 5)]
    with pytest.raises(VerifyError, match=r"F s=1 mb=5 is missing"):
        verify(_broken(base, 1, prog), base.costs)


def test_invariant1_duplicate_op(base):
    prog = list(base.compiled.programs[0])
    prog.insert(1, Instr(Op.F, 0, 0))
    with pytest.raises(VerifyError, match=r"rank 0, instruction 1 \(F s=0 mb=0\): appears more"):
        verify(_broken(base, 0, prog), base.costs)


def test_invariant1_wrong_rank(base):
    prog = list(base.compiled.programs[0])
    prog.insert(0, Instr(Op.F, 2, 0))
    with pytest.raises(VerifyError, match=r"stage 2 is mapped to rank 2"):
        verify(_broken(base, 0, prog), base.costs)


def test_invariant2_dependency_order(base):
    prog = list(base.compiled.programs[3])
    f, bw = prog.index(Instr(Op.F, 3, 0)), prog.index(Instr(Op.BW, 3, 0))
    prog[f], prog[bw] = prog[bw], prog[f]
    with pytest.raises(VerifyError, match=r"rank 3, instruction \d+ \(BW s=3 mb=0\): needs F s=3"):
        verify(_broken(base, 3, prog), base.costs)


def test_invariant2_input_not_received(base):
    prog = [i for i in base.compiled.programs[2] if i != Instr(Op.RECV_ACT, 2, 4, 1)]
    with pytest.raises(VerifyError, match=r"needs F s=1 mb=4, not received from rank 1"):
        verify(_broken(base, 2, prog), base.costs)


def test_invariant3_message_order_mismatch_deadlocks(base):
    # Rank 0 sends mb 1 before mb 0; rank 1 waits for mb 0 first: blocking sends deadlock.
    prog = list(base.compiled.programs[0])
    prog.remove(Instr(Op.SEND_ACT, 0, 0, 1))
    prog.insert(prog.index(Instr(Op.SEND_ACT, 0, 1, 1)) + 1, Instr(Op.SEND_ACT, 0, 0, 1))
    with pytest.raises(VerifyError, match=r"deadlock under blocking send/recv: .*rank 0"):
        verify(_broken(base, 0, prog), base.costs)


def test_invariant3_wrong_peer(base):
    prog = [
        Instr(i.op, i.stage, i.mb, 3) if i.op is Op.SEND_ACT else i
        for i in base.compiled.programs[0]
    ]
    wrong = r"SEND_ACT s=0 mb=0 to=3\): the peer stage 1 is on rank 1"
    with pytest.raises(VerifyError, match=wrong):
        verify(_broken(base, 0, prog), base.costs)


def test_invariant4_memory_limit(base):
    over = r"rank 0, instruction \d+ \(F s=0 mb=3\): 4 stashes live, over the limit 3"
    with pytest.raises(VerifyError, match=over):
        verify(base.compiled, base.costs, memory_limit=3)


def test_invariant4_simulator_disagreement(base):
    disagree = r"rank 0: counted peak 4 stashes, the simulator reports 5"
    with pytest.raises(VerifyError, match=disagree):
        verify(base.compiled, base.costs, peaks=[5, 3, 2, 1])


def test_memory_counts_split_backward_remainder():
    """With a split backward, what B leaves (M_W) stays live until W."""
    from pipec.ir import Compiled, Layout, Pipeline
    from pipec.passes.costs import parse_mem

    layout = Layout(1, (0,), (0,), (Pipeline((0,), (0, 1)),))
    prog = (
        Instr(Op.F, 0, 0),
        Instr(Op.F, 0, 1),
        Instr(Op.B, 0, 0),
        Instr(Op.B, 0, 1),
        Instr(Op.W, 0, 0),
        Instr(Op.W, 0, 1),
        Instr(Op.OPTIMIZER_STEP),
    )
    compiled = Compiled("t", 1, 2, 1, layout, (prog,))
    costs = parse_mem("F=1,W=-0.5", CostModel())
    verify(compiled, costs, peaks=[2.0])
    with pytest.raises(VerifyError, match="over the limit 1.5"):
        verify(compiled, costs, memory_limit=1.5)
