"""The plan's per-rank stash bytes against what the runtime measures, in one torchrun launch.

The plan prices memory from its own profile (each block's stash at the micro-batch size,
summed per chunk); the runtime counts what autograd really saves (saved-tensor hooks). Both
candidates are built with `pipec.plan.build.compile_candidate`, so the programs run are the
ones the plan simulated: plain 1F1B, V-Half, and 1F1B under a budget that makes the BPipe pass evict
rank 0's stashes to rank 3 (counted there by both).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipec.ir import Op
from pipec.plan.build import compile_candidate
from pipec.plan.candidates import PlanRequest
from pipec.plan.driver import plan_profile
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"  # micro-batches of 2
P, MBS, BATCH = 4, 2, 16
TOLERANCE = 0.10

pytestmark = pytest.mark.slow


def candidates() -> dict:
    """Plain 1F1B at mbs 2, the evict candidate under a budget 3.5 stashes of rank 0, and
    V-Half (a V of split backwards: what W holds after B is counted too)."""
    from pipec.plan.profile_mbs import profile_model

    profile = profile_model(GPT, [MBS], time_budget=60, runs=1, peak_flops=1e12, progress=False)
    plain_req = PlanRequest(P, BATCH, 2**40, schedules=("1f1b",), strategies=("plain",))
    plain = plan_profile(profile, plain_req).evaluation.fits[0]
    rank0 = plain.memory[0]
    budget = rank0.total - rank0.stash + int(3.5 * plain.chunks.stash_bytes[0])
    req = PlanRequest(P, BATCH, budget, schedules=("1f1b",), strategies=("plain", "evict"))
    evict = next(e for e in plan_profile(profile, req).evaluation.fits if e.strategy == "evict")
    v_req = PlanRequest(P, BATCH, 2**40, schedules=("v-half",), strategies=("plain",))
    v_half = plan_profile(profile, v_req).evaluation.fits[0]
    return {"plain": plain, "evict": evict, "v-half": v_half}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    chosen = candidates()
    results = {name: compile_candidate(ev, GPT) for name, ev in chosen.items()}
    cases = {name: (result, {"kind": "grads"}) for name, result in results.items()}
    ranks = launch(cases, P, tmp_path_factory.mktemp("plan_runtime"), timeout=300).results
    return chosen, results, ranks


@pytest.mark.parametrize("name", ["plain", "evict", "v-half"])
def test_planned_stash_bytes_match_the_runtime_within_10_percent(measured, name):
    chosen, _, ranks = measured
    for rank, (mem, res) in enumerate(zip(chosen[name].memory, ranks)):
        assert res[name]["ok"], res[name]
        got = res[name]["peak_stash_bytes"]
        assert abs(got - mem.stash) <= TOLERANCE * mem.stash, (rank, got, mem.stash)


def test_the_evict_build_is_the_planned_candidate(measured):
    chosen, results, ranks = measured
    ops = {i.op for prog in results["evict"].compiled.programs for i in prog}
    assert Op.EVICT in ops and Op.ACCEPT in ops
    plain = [res["plain"]["peak_stash_bytes"] for res in ranks]
    evict = [res["evict"]["peak_stash_bytes"] for res in ranks]
    assert evict[0] < plain[0] and evict[3] > plain[3]  # rank 0's stashes live on rank 3
    # The build holds the plan's programs: its simulation gives the plan's figures.
    sim = results["evict"].sim
    assert [r.peak_stash_bytes for r in sim.ranks] == [m.stash for m in chosen["evict"].memory]
    assert sim.bubble == pytest.approx(chosen["evict"].bubble)
