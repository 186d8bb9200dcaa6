"""pipec is never worse than a peer at no more memory: torch's generators run live, the
zero-bubble repository's figures (bench/data/peer-makespans.jsonl) and its V orders as pipec
rebuilds them. The comparison is bench/peers.py's (loaded by path: bench is not a package)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from pipec.passes.costs import CostModel
from pipec.passes.schedules.vbest import makespan, peak, shortest
from pipec.passes.schedules.vshape import reference_orders, v_half_slots, v_min_slots
from pipec.passes.schedules.zbv_fixed import zbv_orders
from pipec.torch_orders import torch_order

_spec = importlib.util.spec_from_file_location(
    "bench_peers", Path(__file__).resolve().parent.parent / "bench" / "peers.py"
)
peers = sys.modules["bench_peers"] = importlib.util.module_from_spec(_spec)  # for dataclasses
_spec.loader.exec_module(peers)

REFERENCE = peers.reference_rows()


@pytest.mark.parametrize("costs", ["unit", "1.5B"])
@pytest.mark.parametrize("p", [4, 5])
def test_never_worse_than_the_peers_computed_in_process(p, costs):
    """Every family against torch's generators and the rebuilt zero-bubble V orders, at every
    limit bench/peers.py runs: no pair where pipec takes longer or holds more."""
    m = 2 * p
    ours = list(peers.pipec_rows(p, m, costs))
    theirs = [*peers.torch_rows(p, m, costs), *peers.reproduced_rows(p, m, costs)]
    found = peers.pairs(ours, theirs)
    compared = {x.ours.family for x in found}
    assert compared == set(peers.GROUP) - {"zb-h2"}  # no peer builds ZB-H2
    assert [x for x in found if x.worse] == []


def _reference_pairs(small: bool) -> list:
    rows = [r for r in REFERENCE if (r.p <= 8) == small]
    wanted = sorted({(r.family, r.p, r.m, r.costs, r.limit) for r in rows}, key=str)
    ours = [row for key in wanted if (row := peers.pipec_row(*key)) is not None]
    assert len(ours) == len(wanted)
    return peers.pairs(ours, rows)


def test_never_worse_than_the_reference_figures():
    """The zero-bubble repository's and torch's figures at p = 4 and 8 (p = 16 below)."""
    found = _reference_pairs(small=True)
    assert len(found) >= 125
    assert [x for x in found if x.worse] == []


@pytest.mark.slow
def test_never_worse_than_the_reference_figures_at_p16():
    found = _reference_pairs(small=False)
    assert len(found) >= 31
    assert [x for x in found if x.worse] == []


@pytest.mark.parametrize("name, slots", [("v-min", v_min_slots), ("v-half", v_half_slots)])
def test_rebuilt_zbv_greedy_orders_take_the_references_time(name, slots):
    """The zero-bubble repository's V-Min/V-Half rebuilt in pure Python: exactly its figures."""
    rows = [r for r in REFERENCE if r.family == name and r.who.startswith("zb zbv_greedy")]
    assert len(rows) == 10
    for r in rows:
        orders = reference_orders(slots, r.p, r.m)
        assert makespan(orders, peers.COSTS[r.costs]) == pytest.approx(r.makespan, abs=5e-4)
        assert peak(orders, peers.COSTS[r.costs]) == r.peak


@pytest.mark.parametrize("p, m", [(2, 1), (2, 5), (3, 4), (4, 8), (5, 7), (6, 30), (7, 9)])
def test_zbv_orders_are_torchs(p, m):
    """torch's ScheduleZBVZeroBubble order, rebuilt without torch: the same passes in the same
    order on every rank (chunk 0 is stage r, chunk 1 stage 2p-1-r)."""
    _, rows, _ = torch_order("ZBVZeroBubble", p, m, 2)
    name = {("F", 0): "F", ("F", 1): "f", ("I", 1): "B", ("I", 0): "b", ("W", 1): "W"}
    name[("W", 0)] = "w"
    theirs = [
        [name[(a.type, int(a.stage != r))] for cell in row for a in cell if a.type in "FIW"]
        for r, row in enumerate(rows)
    ]
    assert zbv_orders(p, m) == theirs


def test_shortest_keeps_the_first_of_equals_and_respects_the_bound():
    """Ties keep the earlier candidate (the family's own construction); a candidate over the
    bound is never chosen, however short."""
    unit = CostModel(per="chunk")
    zbv, half = zbv_orders(4, 8), reference_orders(v_half_slots, 4, 8)
    assert makespan(zbv, unit) < makespan(half, unit) and peak(zbv, unit) > peak(half, unit)
    assert shortest([half, zbv], unit, bound=peak(half, unit)) is half
    assert shortest([half, zbv], unit) is zbv
    again = [list(row) for row in zbv]
    assert shortest([zbv, again], unit) is zbv and shortest([again, zbv], unit) is again
    assert shortest([zbv], unit, bound=1.0) is None
