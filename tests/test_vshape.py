"""V-shape schedules: V-Min, V-Half, V-ZB (NeurIPS 2024 building blocks) and ZB-V (ICLR 2024)."""

from math import ceil

import pytest

from pipec.ir import PipecError
from pipec.passes.schedules.vblocks import T
from pipec.passes.schedules.vshape import block_of, v_half_slots, v_min_slots, v_zb_slots
from tests.helpers import CHUNK_UNITS, peaks, run

SLOTS = {"v-min": v_min_slots, "v-half": v_half_slots, "v-zb": v_zb_slots}


def wall_bubble(result) -> float:
    """Makespan minus one rank's work (every rank does 2m chunk passes of each kind)."""
    return result.sim.makespan - result.sim.ranks[0].busy


@pytest.mark.parametrize(
    "name, p, m, makespan, peak",
    [  # the reference implementation's figures: match or beat them, never at a higher peak
        ("v-min", 4, 16, 107, 2),
        ("v-min", 8, 32, 219, 4),
        ("v-half", 4, 16, 101, 3),
        ("v-half", 8, 32, 209, 5),
    ],
)
def test_reference_figures(name, p, m, makespan, peak):
    r = run(name, p, m, costs=CHUNK_UNITS)
    assert r.sim.makespan <= makespan and max(peaks(r)) <= peak


@pytest.mark.parametrize("p", [3, 4, 5, 6, 7, 9, 10])
def test_bubbles_and_peaks_follow_the_formulas(p):
    """V-Min: bubble 4p-5 (4p-7 when 3 | p) at (p+4)//3 stashes; V-Half: 3p-7 (even p) or
    3p-4 (odd p) at (p+2)//2 stashes; V-ZB: no rank idles inside its span, p stashes. The
    bubbles are in the paper's chunk units."""
    m = 2 * p
    v_min, v_half, v_zb = (
        run(name, p, m, costs=CHUNK_UNITS) for name in ("v-min", "v-half", "v-zb")
    )
    assert wall_bubble(v_min) == (4 * p - 7 if p % 3 == 0 else 4 * p - 5)
    assert max(peaks(v_min)) == (p + 4) // 3
    assert wall_bubble(v_half) == (3 * p - 7 if p % 2 == 0 else 3 * p - 4)
    assert max(peaks(v_half)) == (p + 2) // 2
    assert v_zb.sim.span_bubble == 0 and max(peaks(v_zb)) == p


@pytest.mark.parametrize("name", sorted(SLOTS))
@pytest.mark.parametrize("p", [4, 5, 8, 9])
def test_peak_follows_the_lifespan_rule(name, p):
    """Each rank's peak <= sum over its two stages of ceil(lifespan / T) chunk stashes, a
    stage's lifespan running from its F's start to its W's end in the building block."""
    block = block_of(SLOTS[name], p)
    bound = [
        0.5 * (ceil((w + 1 - f0) / T) + ceil((w1 + 1 - f1) / T)) for f0, f1, _, _, w1, w in block
    ]
    got = peaks(run(name, p, 3 * p))
    assert all(g <= b for g, b in zip(got, bound)), (got, bound)


def test_published_offsets_are_reproduced_by_the_block():
    for p in (3, 4, 6, 7):
        for slots in SLOTS.values():
            block = block_of(slots, p)
            assert [tuple(b[:4]) for b in block] == [slots(p, r) for r in range(p)]


def test_v_min_bubble_repeats_with_m_and_v_half_does_not():
    """With F=3, B=4, W=2 per chunk V-Min's stable phase itself has a bubble (it grows with m)."""
    grow = {
        name: [
            wall_bubble(run(name, 4, m, costs=f"{CHUNK_UNITS},F=3,B=4,W=2")) for m in (8, 16, 32)
        ]
        for name in ("v-min", "v-half")
    }
    assert grow["v-min"][0] < grow["v-min"][1] < grow["v-min"][2]
    assert grow["v-half"][0] == grow["v-half"][1] == grow["v-half"][2]


@pytest.mark.parametrize("p, m", [(4, 8), (8, 16)])
def test_zb_v_zero_bubble_at_1f1b_memory(p, m):
    r = run("zb-v", p, m)
    assert r.sim.span_bubble == 0 and max(peaks(r)) == p


def test_zb_v_beats_zb_h1_with_real_costs():
    """Same model, same costs, same memory (p stashes): ZB-V's chunks are half a rank's share,
    so each takes half the cost; per chunk op that is F=1.5, B=2, W=1."""
    zbv = run("zb-v", 8, 24, costs="F=3,B=4,W=2")
    h1 = run("zb-h1", 8, 24, costs="F=3,B=4,W=2")
    assert zbv.sim.makespan < h1.sim.makespan and max(peaks(zbv)) <= 8
    assert zbv.sim.makespan == run("zb-v", 8, 24, costs="per=chunk,F=1.5,B=2,W=1").sim.makespan
    assert all(z.busy == h.busy for z, h in zip(zbv.sim.ranks, h1.sim.ranks))


@pytest.mark.parametrize("name", ["v-min", "v-half", "v-zb", "zb-v", "v-adaptive"])
@pytest.mark.parametrize(
    "p, m, message",
    [
        (1, 4, r"--pp must be at least 2 for a V placement \(got 1\)"),
        (4, 1, r"--microbatches must be at least 2 \(got 1\)"),
    ],
)
def test_v_families_refuse_a_degenerate_v(name, p, m, message):
    with pytest.raises(PipecError, match=f"{name}: {message}"):
        run(name, p, m)


def test_memory_limit_below_the_peak_names_the_smallest_feasible():
    with pytest.raises(
        PipecError,
        match=r"v-half peaks at 3 stashes at p=4, m=8: --memory-limit 2"
        r" is below it; use at least 3",
    ):
        run("v-half", 4, 8, memory_limit=2)
