"""Composability: eviction on every schedule's programs verifies and meets the limit.

The grid draws (schedule, p, m, v), a machine (none, one node, or two nodes with a slow
inter-node link) and a placement, then every limit from the smallest feasible (the balanced
bound) up to the peak without eviction, on the grid of levels a rank can reach.
"""

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipec.ir import PipecError
from pipec.passes.costs import CostModel
from pipec.passes.evict import EvictionPlanner
from pipec.passes.lower import lower
from pipec.passes.mapping import PLACEMENTS, remap
from pipec.passes.registry import SCHEDULES, Request, build_schedule, family
from pipec.passes.simulate import simulate
from pipec.passes.topology import make_topology
from pipec.passes.verify import verify

family("1f1b")  # registers the built-in families

#: Families eviction must compose with. The zero-bubble and V-shape families of issue 3 join
#: this list when they are merged: "zb-h1", "v-half".
EVICT_SCHEDULES = ["gpipe", "1f1b", "1f1b-r", "interleaved", "zb-h1", "v-half"]


@st.composite
def machines(draw, p: int) -> CostModel:
    kind = draw(st.sampled_from(["flat", "one node", "two nodes"]))
    if kind == "flat":
        return CostModel(comm=draw(st.sampled_from([0.0, 0.1])))
    bandwidth = draw(st.sampled_from([8.0, 2.0, 0.5]))
    if kind == "one node" or p % 2:
        return replace(CostModel(), topology=make_topology(p, 1, None, f"intra={bandwidth}:0.01"))
    link = f"intra={bandwidth}:0.01,inter={bandwidth / 10}:0.05"
    return replace(CostModel(), topology=make_topology(p, 2, None, link))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
@pytest.mark.parametrize("name", EVICT_SCHEDULES)
def test_evictions_verify_and_meet_every_feasible_limit(name, data):
    fam = SCHEDULES[name]
    p = data.draw(st.integers(2, 8), label="p")
    if data.draw(st.booleans(), label="m a multiple of p"):
        m = p * data.draw(st.integers(1, 3), label="m / p")
    else:
        m = data.draw(st.integers(1, 3 * p), label="m")
    more = [] if fam.chunks == "1" else [fam.default_v + 1]
    v = data.draw(st.sampled_from([fam.default_v, *more]), label="v")
    costs = data.draw(machines(p), label="costs")
    try:
        sched = build_schedule(name, Request(p, m, v, costs))
    except PipecError:
        assume(False)
    placement = data.draw(st.sampled_from(sorted(PLACEMENTS)), label="mapping")
    try:
        devices = PLACEMENTS[placement](sched.layout, costs.topology)
    except PipecError:
        assume(False)
    planner = EvictionPlanner(lower(remap(sched, devices), costs), costs)
    low, top, step = planner.smallest_feasible(), planner.peak, planner.size
    limits = {low, top} | {low + k * step for k in range(int((top - low) / step + 1e-9) + 1)}
    for limit in sorted(limits):
        compiled = planner.evict(limit)
        sim = simulate(compiled.layout, compiled.programs, costs)
        found = [r.peak_activations for r in sim.ranks]
        verify(compiled, costs, found, limit)  # residency, deadlock freedom, memory
        assert max(found) <= limit + 1e-9
    if name == "1f1b" and m >= p:
        assert low == math.ceil((p + 1) / 2)
    if low > step:
        with pytest.raises(PipecError, match=f"the smallest feasible limit is {low:g}$"):
            planner.evict(low - step)
