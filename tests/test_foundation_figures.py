"""The figures issue 2 holds the foundation schedules to (unit costs unless stated)."""

import pytest

from tests.helpers import peaks, run


def test_1f1b_p4_m8():
    r = run("1f1b", 4, 8)
    assert r.sim.makespan == 33
    assert round(r.sim.bubble, 4) == 0.2727
    assert peaks(r)[0] == 4 and peaks(r)[3] == 1


def test_1f1b_p8_m24():
    assert run("1f1b", 8, 24).sim.makespan == 93


def test_gpipe_p4_m8():
    r = run("gpipe", 4, 8)
    assert r.sim.makespan == 33
    assert peaks(r) == [8, 8, 8, 8]


def test_interleaved_v2_chunks_take_half_a_share():
    """At the same (default) costs as 1F1B each chunk op takes half, so every rank does 1F1B's
    work: 28.5 against 1F1B's 33, the bubble (p-1)(F+B+W)/v. Per chunk op that is F=0.5."""
    r = run("interleaved", 4, 8, 2)
    assert r.sim.makespan == 28.5
    assert [s.busy for s in r.sim.ranks] == [s.busy for s in run("1f1b", 4, 8).sim.ranks]
    assert peaks(r) == [5.5, 4.5, 3.5, 2.5]
    assert run("interleaved", 4, 8, 2, costs="per=chunk,F=0.5,B=0.5,W=0.5").sim.makespan == 28.5


@pytest.mark.parametrize(
    "costs, expected",
    [
        ("F=18.522,B=18.086,W=9.337,comm=0.601", 0.2431),  # 1.5B, zero-bubble paper Table 5
        ("F=29.718,B=29.444,W=19.927,comm=0.527", 0.2347),  # 6.2B
    ],
)
def test_1f1b_span_bubble_matches_zero_bubble_table5(costs, expected):
    assert round(run("1f1b", 8, 24, costs=costs).sim.span_bubble, 4) == expected


def test_1f1b_bubble_matches_formula():
    """1F1B's bubble fraction is (p-1)/(m+p-1) with unit costs and no communication."""
    for p, m in [(2, 3), (4, 8), (8, 24), (5, 7)]:
        assert run("1f1b", p, m).sim.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_recompute_stashes_only_inputs_until_the_backward():
    plain, recomputed = run("1f1b", 4, 8), run("1f1b-r", 4, 8)
    assert max(peaks(recomputed)) < max(peaks(plain))
    # Rank 0 holds 3 input stashes (1/16 each) while recomputing one full stash.
    assert peaks(recomputed)[0] == pytest.approx(1 + 3 / 16)
    assert recomputed.sim.makespan > plain.sim.makespan
