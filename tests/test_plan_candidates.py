"""The planner on injected MFU curves: when saving memory pays, baselines, budgets, bad input."""

from dataclasses import replace

import pytest
from plan_synthetic import INPUT_PER_SAMPLE, PARAMS, STASH_PER_SAMPLE, synthetic_profile

from pipec.codegen.render import format_bytes
from pipec.ir import PipecError
from pipec.plan import candidates
from pipec.plan.candidates import STRATEGIES, PlanRequest
from pipec.plan.driver import check, plan_profile
from pipec.plan.report import render_json, render_text, rows

P, BATCH = 4, 64
# p=4 over 8 blocks: each rank holds 2 blocks. Static bytes: 2·1000 fp32 parameters at
# 4 (weights) + 4 (gradients) + 8 (AdamW moments) bytes each.
STATIC = 2 * PARAMS * 16
CHUNK_STASH = 2 * STASH_PER_SAMPLE  # per sample
MESSAGE = INPUT_PER_SAMPLE  # per sample: a chunk's output is the next block's input
# Per sample, rank 0's peak in the steady state (m > p), when a gradient arrives (a GPU run:
# receives posted in place). 1F1B: p stashes, the p stage outputs they keep for the backward,
# the gradient. 1F1B-R: the p - 1 inputs of the micro-batches in flight, the recomputed stash
# and its output, the gradient.
PLAIN_1F1B = 4 * CHUNK_STASH + 5 * MESSAGE
RECOMPUTE_1F1B = 3 * INPUT_PER_SAMPLE + CHUNK_STASH + 2 * MESSAGE
# Plain 1F1B fits mbs <= 4 (65 240 B at 4, 98 480 B at 8); 1F1B-R mbs <= 16 (68 960 B at 16);
# eviction unlocks mbs 8 (82 480 B: rank 0 sheds a stash; rank 1 holds 3, 81 984 B).
BUDGET = 85_000

MEMORY_SAVING = ["recompute", "evict"]


def flat(n: int) -> float:
    return 0.5  # flash-attention-like: kernels are as efficient at every micro-batch size


def rising(n: int) -> float:
    return min(0.05 * n, 0.8)  # GPT-3 without flash attention: larger micro-batches pay


def plan(mfu, strategy: str, budget: int = BUDGET):
    req = PlanRequest(P, BATCH, budget, schedules=("1f1b",), strategies=("plain", strategy))
    return plan_profile(synthetic_profile(mfu), req)


def test_budget_arithmetic_matches_the_hand_figures():
    result = plan(flat, "recompute")
    evaluated = result.evaluation.fits + result.evaluation.over
    rank0 = {(e.strategy, e.mbs): e.memory[0].total for e in evaluated}
    for mbs in (1, 2, 4, 8):  # m = 64 / mbs > p: the steady state is reached
        assert rank0[("plain", mbs)] == STATIC + mbs * PLAIN_1F1B
        assert rank0[("recompute", mbs)] == STATIC + mbs * RECOMPUTE_1F1B
    for e in evaluated:  # a candidate is as large as its largest rank
        assert e.peak_bytes == max(m.total for m in e.memory)
    assert {e.mbs for e in result.evaluation.fits if e.strategy == "plain"} == {1, 2, 4}
    assert [e.mbs for e in result.evaluation.over] == [8, 16]  # plain only
    assert result.baseline.mbs == 4 and result.baseline.strategy == "plain"


@pytest.mark.parametrize("strategy", MEMORY_SAVING)
def test_flat_mfu_keeps_plain_1f1b(strategy):
    result = plan(flat, strategy)
    table = rows(result)
    best_plain = min(r.ev.iteration_s for r in table if r.ev.strategy == "plain")
    assert table[0].ev.strategy == "plain"
    assert all(r.ev.iteration_s > best_plain for r in table if r.ev.strategy == strategy)
    # The paper's quick estimate says so too: no larger micro-batch raises MFU.
    assert all(r.mfu_bound == pytest.approx(1.0) for r in table)
    assert "memory saving does not pay" in render_text(result)


@pytest.mark.parametrize("strategy", MEMORY_SAVING)
def test_rising_mfu_prefers_the_strategy_that_unlocks_a_larger_micro_batch(strategy):
    result = plan(rising, strategy)
    table = rows(result)
    best = table[0]
    assert best.ev.strategy == strategy and best.ev.mbs > result.baseline.mbs
    assert best.speedup > 1.5
    # The quick estimate bounds the gain of a larger micro-batch from above.
    for r in table:
        if r.ev.strategy == strategy and r.ev.mbs > result.baseline.mbs:
            assert r.speedup <= r.mfu_bound
    assert "memory saving pays" in render_text(result)


def test_a_budget_that_fits_nothing_names_the_smallest_that_fits_one():
    smallest = STATIC + RECOMPUTE_1F1B  # 1F1B-R at mbs 1
    # Every family; eviction's own "fits nothing" figure is the next test (it costs a search
    # for the smallest feasible limit per family and size, which this one need not pay).
    strategies = ("plain", "recompute")
    with pytest.raises(PipecError) as e:
        plan_profile(synthetic_profile(flat), PlanRequest(P, BATCH, 10_000, strategies=strategies))
    expected = f"is {format_bytes(smallest)} ({smallest} bytes: 1f1b-r recompute at mbs 1)"
    assert str(e.value).startswith("--memory-per-device 9.77 KiB fits no candidate")
    assert str(e.value).endswith(f"; the smallest that fits one {expected}")
    assert "\n" not in str(e.value)
    fits = plan_profile(
        synthetic_profile(flat), PlanRequest(P, BATCH, smallest, strategies=strategies)
    )
    assert [(e.schedule, e.mbs) for e in fits.evaluation.fits] == [("1f1b-r", 1)]
    assert fits.baseline is None and "fits at no micro-batch size" in render_text(fits)


def test_when_nothing_fits_eviction_names_the_memory_it_needs():
    # 1F1B at mbs 1: rank 0 stashes 4 · 2000 B. Far below, eviction's smallest feasible limit
    # is the candidate, over the budget; a budget of exactly its peak then fits it.
    req = PlanRequest(P, BATCH, 10_000, schedules=("1f1b",), strategies=("plain", "evict"))
    with pytest.raises(PipecError, match=r"fits no candidate; the smallest that fits one is") as e:
        plan_profile(synthetic_profile(flat), req)
    smallest = int(str(e.value).split("(")[1].split(" bytes")[0])
    assert str(e.value).endswith("bytes: 1f1b evict at mbs 1)")
    assert smallest < STATIC + PLAIN_1F1B  # eviction needs less than plain 1F1B
    fits = plan_profile(synthetic_profile(flat), replace(req, bytes_per_device=smallest))
    assert [(e.strategy, e.mbs, e.peak_bytes) for e in fits.evaluation.fits] == [
        ("evict", 1, smallest)
    ]


def test_a_strategy_is_one_row_of_the_table(monkeypatch):
    # A strategy that only asks the verifier to hold the budget, in stash units: 1F1B holds 4
    # units on rank 0; the budget leaves (85 000 - 32 000 - 5 · 62 · mbs) / (2000 · mbs) units
    # (`eviction_limit`), 6.5 at mbs 4 and 3.2 at mbs 8, so it compiles at mbs <= 4 and is
    # refused above.
    def capped(req, budget):
        return (replace(req, memory_limit=budget.stash_limit),)

    monkeypatch.setitem(STRATEGIES, "capped", ("verify the budget", capped))
    result = plan(flat, "capped")
    assert {e.mbs for e in result.evaluation.fits if e.strategy == "capped"} == set()  # dupes
    refused = {s.mbs for s in result.evaluation.skipped if s.strategy == "capped"}
    assert refused == {1, 2, 4, 8, 16}
    reasons = {s.mbs: s.reason for s in result.evaluation.skipped if s.strategy == "capped"}
    assert reasons[4] == "same as 1f1b plain" and "limit" in reasons[8]


def test_batch_arithmetic():
    assert check(PlanRequest(4, 64, BUDGET)) == [1, 2, 4, 8, 16, 32, 64]
    assert check(PlanRequest(4, 48, BUDGET, dp=2)) == [1, 2, 4, 8]
    with pytest.raises(PipecError, match="--global-batch 30 is not divisible by --dp 4"):
        check(PlanRequest(4, 30, BUDGET, dp=4))
    with pytest.raises(PipecError, match="--mbs 3 does not divide the per-replica batch 32"):
        check(PlanRequest(4, 64, BUDGET, dp=2), [2, 3])
    with pytest.raises(PipecError, match="--pp must be at least 1"):
        check(PlanRequest(0, 64, BUDGET))


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(PipecError, match="unknown schedule 'zz'; valid schedules: .*1f1b"):
        plan_profile(synthetic_profile(flat), PlanRequest(P, BATCH, BUDGET, schedules=("zz",)))


def test_json_lists_every_candidate_with_its_figures():
    result = plan_profile(synthetic_profile(rising), PlanRequest(P, BATCH, BUDGET))
    out = render_json(result)
    n = len(result.evaluation.fits)
    assert len(out["candidates"]) == n and out["baseline"]["mbs"] == 4
    first = out["candidates"][0]
    assert first["tokens_per_s"] == pytest.approx(BATCH * 128 / first["iteration_s"])
    assert {s["reason"] for s in out["skipped"]} >= {"does not apply"}


def eviction_limit(mbs: int) -> float:
    """The stash units the budget leaves 1F1B at `mbs`: rank 0 holds the most beside its
    stashes, its static bytes and at most 5 messages (the 4 stage outputs kept and a gradient
    received; 4 when m = p, as its gradients exist only from its first backward on, when 3
    outputs are left), and every rank's stash unit weighs one chunk's stash."""
    messages = 5 if BATCH // mbs > P else 4
    return (BUDGET - STATIC - messages * MESSAGE * mbs) / (CHUNK_STASH * mbs)


def test_the_evict_row_hands_the_pass_the_budget_in_stash_units(monkeypatch):
    # The evict row asks compile_schedule for the BPipe pass (evict=True) under the stash
    # units the byte budget leaves beside what eviction cannot move.
    calls = []
    real = candidates.compile_schedule

    def compile_with_evict(schedule, p, m, v, costs, memory_limit, evict=False):
        calls.append((BATCH // m, memory_limit, evict))
        return real(schedule, p, m, v, costs)

    monkeypatch.setattr(candidates, "compile_schedule", compile_with_evict)
    plan(flat, "evict")
    evicting = [(mbs, limit) for mbs, limit, evict in calls if evict]
    assert evicting == [(mbs, pytest.approx(eviction_limit(mbs))) for mbs in (1, 2, 4, 8, 16)]


def test_an_iteration_ends_when_the_slowest_rank_has_stepped():
    # Each block's AdamW step takes 1 ms; rank 0 holds two blocks and runs 1F1B's last
    # backward, so its step ends the iteration 2 ms after the makespan.
    profile = synthetic_profile(flat)
    blocks = tuple(replace(b, optimizer_s=1e-3) for b in profile.blocks)
    stepped = replace(profile, blocks=blocks)
    req = PlanRequest(P, BATCH, BUDGET, schedules=("1f1b",), strategies=("plain",))
    before = {e.mbs: e.iteration_s for e in plan_profile(profile, req).evaluation.fits}
    after = {e.mbs: e.iteration_s for e in plan_profile(stepped, req).evaluation.fits}
    assert after == {mbs: pytest.approx(t + 2e-3) for mbs, t in before.items()}


@pytest.mark.parametrize(
    "device, schedule, mbs", [("cuda", "1f1b", 4), ("cuda", "interleaved", 4), ("cpu", "1f1b", 16)]
)
def test_an_eviction_row_under_the_limit_its_budget_implies_fits_the_budget(device, schedule, mbs):
    # Budgets from the plain row's peak down in steps of 1.5%; wherever the pass meets the
    # derived limit (the row carries it), the evicting programs' predicted peak is within the
    # budget on every rank. (Below the smallest feasible limit the row is the pass's own
    # smallest instead, judged by its own peak.)
    profile = synthetic_profile(flat, sizes=(mbs,), device=device)
    req = PlanRequest(P, BATCH, 10**9, schedules=(schedule,), strategies=("plain",))
    top = next(e for e in plan_profile(profile, req).evaluation.fits if e.schedule == schedule)
    evicting = 0
    for k in range(1, 10):
        budget = int(top.peak_bytes * (1 - 0.015 * k))
        found = candidates.evaluate(
            profile, replace(req, bytes_per_device=budget, strategies=("evict",))
        )
        for ev in found.fits + found.over:
            if ev.schedule == schedule and ev.request.memory_limit is not None:
                assert ev.peak_bytes <= budget, (budget, ev.request, [m.total for m in ev.memory])
                evicting += 1
    assert evicting >= 5
