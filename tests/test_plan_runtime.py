"""The plan's memory against the runtime's, in one torchrun launch.

The plan prices memory from its own profile: each block's stash, boundary bytes and, on CPU,
host records and W's hold at the micro-batch size, summed per chunk. The runtime counts what
autograd really saves (the stash counter) and what the process really holds (the meter).
Candidates are built with `pipec.plan.build.compile_candidate`, so the programs run are the
ones the plan simulated: plain 1F1B, V-Half (split backwards: what W holds after B counts
too), and 1F1B under a budget that makes the BPipe pass evict rank 0's stashes to rank 3.
Each trains three steps; the real peak of the later ones is compared with the plan's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipec.ir import Op
from pipec.plan.build import compile_candidate
from pipec.plan.candidates import PlanRequest
from pipec.plan.driver import plan_profile
from pipec.plan.memory import predicted
from pipec.runtime.measure import predicted_peaks
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"  # micro-batches of 2
P, MBS, BATCH = 4, 2, 16
TOLERANCE = 0.10
MEMORY = {"kind": "memory", "steps": 3, "lr": 1e-3}
NAMES = ["plain", "evict", "v-half"]

pytestmark = pytest.mark.slow


def candidates() -> dict:
    """Plain 1F1B at mbs 2, the evict candidate under a budget half a stash below plain's
    rank 0, and V-Half."""
    from pipec.plan.profile_mbs import profile_model

    profile = profile_model(GPT, [MBS], time_budget=60, runs=1, peak_flops=1e12, progress=False)
    plain_req = PlanRequest(P, BATCH, 2**40, schedules=("1f1b",), strategies=("plain",))
    plain = plan_profile(profile, plain_req).evaluation.fits[0]
    budget = plain.memory[0].total - plain.chunks.stash_bytes[0] // 2
    req = PlanRequest(P, BATCH, budget, schedules=("1f1b",), strategies=("plain", "evict"))
    evict = next(e for e in plan_profile(profile, req).evaluation.fits if e.strategy == "evict")
    v_req = PlanRequest(P, BATCH, 2**40, schedules=("v-half",), strategies=("plain",))
    v_half = plan_profile(profile, v_req).evaluation.fits[0]
    return {"plain": plain, "evict": evict, "v-half": v_half}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    chosen = candidates()
    results = {name: compile_candidate(ev, GPT) for name, ev in chosen.items()}
    cases = {name: (result, MEMORY) for name, result in results.items()}
    ranks = launch(cases, P, tmp_path_factory.mktemp("plan_runtime"), timeout=600).results
    return chosen, results, ranks


@pytest.mark.parametrize("name", NAMES)
def test_real_peaks_are_the_plans_within_10_percent(measured, name):
    chosen, _, ranks = measured
    for rank, (mem, res) in enumerate(zip(chosen[name].memory, ranks)):
        assert res[name]["ok"] and res[name]["max_abs_diff"] == 0.0, res[name]
        real = res[name]["real_peak_bytes"]
        assert abs(real - mem.total) <= TOLERANCE * mem.total, (rank, real, mem.to_json())


@pytest.mark.parametrize("name", NAMES)
def test_planned_stash_bytes_match_the_stash_counter_within_10_percent(measured, name):
    # The simulator's stash peak priced with the plan's profile (the build keeps its costs)
    # against the bytes autograd saved.
    _, results, ranks = measured
    for rank, (sim, res) in enumerate(zip(results[name].sim.ranks, ranks)):
        got, planned = res[name]["peak_stash_bytes"], sim.peak_stash_bytes
        assert abs(got - planned) <= TOLERANCE * planned, (rank, got, planned)


@pytest.mark.parametrize("name", NAMES)
def test_the_plan_predicts_what_the_runtime_predicts_for_its_build(measured, name):
    # One prediction, two sources of facts: the plan's per-block profile summed per chunk,
    # and the runtime's own measure of each stage of the build (runtime/measure.py).
    chosen, results, _ = measured
    r = results[name]
    built = predicted_peaks(r.plan, r.compiled, r.costs, r.sim, "cpu")
    for rank, (plan, own) in enumerate(zip(chosen[name].memory, built)):
        assert abs(plan.total - own.total) <= 0.02 * own.total, (rank, plan, own)


def test_the_evict_build_is_the_planned_candidate(measured):
    chosen, results, ranks = measured
    ops = {i.op for prog in results["evict"].compiled.programs for i in prog}
    assert Op.EVICT in ops and Op.ACCEPT in ops
    plain = [res["plain"]["real_peak_bytes"] for res in ranks]
    evict = [res["evict"]["real_peak_bytes"] for res in ranks]
    assert evict[0] < plain[0] and evict[3] > plain[3]  # rank 0's stashes live on rank 3
    # The build holds the plan's programs: priced in ms, it predicts the plan's figures.
    ev = chosen["evict"]
    assert tuple(s.peak() for s in predicted(results["evict"], ev.chunks, "cpu")) == ev.memory
    assert results["evict"].sim.bubble == pytest.approx(ev.bubble)
