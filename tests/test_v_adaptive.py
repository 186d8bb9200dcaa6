"""V-Adaptive: the building-block search under a memory limit (NeurIPS 2024, section 3.3)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.ir import PipecError
from pipec.passes.verify import verify
from tests.helpers import peaks, run

# p = 8, unit chunk costs: limit (stashes; a chunk's stash is 0.5) -> bubble at most, in chunk
# units, span-based (the reference's 6p - 1 - 3·peak for peaks of up to ~1.5 p chunk stashes).
TABLE = [(4, 23), (4.5, 20), (5, 17), (5.5, 14), (6, 11), (6.5, 8), (7, 5), (7.5, 3), (8, 0)]


@pytest.mark.parametrize("limit, bubble", TABLE)
def test_bubble_under_each_memory_limit(limit, bubble):
    r = run("v-adaptive", 8, 16, memory_limit=limit)
    assert max(s.span - s.busy for s in r.sim.ranks) <= bubble
    assert max(peaks(r)) <= limit


def test_an_infeasible_limit_names_the_smallest_feasible():
    with pytest.raises(
        PipecError,
        match=r"--memory-limit 3.5 is below the smallest feasible at "
        r"p=8, m=16: 4 .*; use at least 4$",
    ):
        run("v-adaptive", 8, 16, memory_limit=3.5)
    assert max(peaks(run("v-adaptive", 8, 16, memory_limit=4))) == 4


def test_real_costs_never_exceed_the_limit_and_beat_v_min():
    costs = "F=3,B=4,W=2"
    adaptive = run("v-adaptive", 4, 16, costs=costs, memory_limit=2)
    assert max(peaks(adaptive)) <= 2
    assert adaptive.sim.makespan <= run("v-min", 4, 16, costs=costs).sim.makespan


# The foundation's property grid (tests/test_verify.py) draws p up to 16 and m up to 64; a
# search there costs seconds per draw, so v-adaptive gets this smaller grid instead.
@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(2, 24), limit=st.sampled_from([None, 1.5, 2, 3, 4.5]))
def test_every_program_verifies_within_its_limit(p, m, limit):
    try:
        r = run("v-adaptive", p, m, memory_limit=limit)
    except PipecError as e:
        assert "smallest feasible" in str(e)
        return
    verify(r.compiled, r.costs, peaks(r), limit)
    assert max(peaks(r)) <= (p if limit is None else limit)
