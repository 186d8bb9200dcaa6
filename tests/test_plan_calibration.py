"""A plan calibrated from runs, on synthetic measurements: factors, corrections, ties, the
runtime's cost per instruction in the simulator, what `pipec show` and a run are told.

Runs are made up from a "true" machine: the synthetic profile scaled by known factors plus a
cost per instruction. Folding them back must recover those factors, predict the runs, and
state the smallest expected error; nothing here is timed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from plan_synthetic import synthetic_profile

from pipec.codegen.render import op_kinds_line
from pipec.compile import compile_schedule
from pipec.ir import COMPUTE_OPS, MEMORY_OPS, Op
from pipec.passes.costs import CostModel
from pipec.passes.registry import Request
from pipec.passes.simulate import instruction_charges, simulate
from pipec.plan import saved as saved_mod
from pipec.plan.build import planned_row
from pipec.plan.calibration import MIN_ERROR, Calibration, Observed, fold, predict, spread
from pipec.plan.candidates import PlanRequest, price
from pipec.plan.conditions import Conditions, notice
from pipec.plan.driver import calibrate, plan_profile
from pipec.plan.observe import merge_turns
from pipec.plan.ranking import groups, ranked
from pipec.plan.report import render_json, render_text
from pipec.runtime.measure import RankReport, kind_ratios, summarize
from tests.helpers import run

P, BATCH, MBS = 4, 32, 4
REQ = PlanRequest(P, BATCH, 2**40, schedules=("1f1b", "zb-h1", "interleaved"))
TRUTH = {"F": 1.2, "B": 1.3, "W": 1.5, "BW": 1.1}
INSTR_S = 2e-6
CONDITIONS = Conditions(1, P, "fp32", "2.13.0", "cpu", 2, 0.5)


def flat(n: int) -> float:
    return 0.5


def truth(sizes=(MBS,)) -> Calibration:
    """The machine the made-up runs ran on."""
    factors = tuple((n, k, f) for n in sizes for k, f in TRUTH.items())
    return Calibration(factors, 1.0, tuple((n, INSTR_S) for n in sizes), None, None)


def made_up_run(schedule: str, slower: float = 1.0, mbs: int = MBS) -> Observed:
    """A run of `schedule` on the true machine, `slower` than its model (a miss the factors
    cannot explain); its op sums are the profile's times the true factors."""
    raw = synthetic_profile(flat)
    m = BATCH // mbs
    layout, _, costs = price(raw, schedule, Request(P, m, 1), mbs)
    compiled = compile_schedule(schedule, P, m, 1, costs).compiled
    split = Op.W in {i.op for prog in compiled.programs for i in prog}
    raw_chunks = raw.chunks(layout.n_chunks, mbs)
    kinds = {}
    for stage, chunk in enumerate(layout.stage_chunk):
        c = raw_chunks.seconds[chunk]
        priced = {"F": c.F, "B": c.B, "W": c.W} if split else {"F": c.F, "BW": c.B + c.W}
        for kind, s in priced.items():
            m_s, p_s = kinds.get(kind, (0.0, 0.0))
            kinds[kind] = (m_s + s * TRUTH[kind], p_s + s)
    o = Observed(
        f"{schedule} mbs {mbs}",
        f"{schedule} plain",
        mbs,
        tuple((k, m_s, p_s) for k, (m_s, p_s) in sorted(kinds.items())),
        (0.0, 0.0),
        INSTR_S,
        (),
        "fp32",
        compiled,
    )
    cal = truth((mbs,))
    measured = predict(cal.apply(raw), cal.priced(REQ), o) * slower
    return replace(o, iterations=(measured,) * 5)


def test_each_instruction_costs_its_rank_the_runtimes_time():
    result = run("1f1b", 4, 8, None, "F=1,B=2,W=0,comm=0.3")
    c = result.compiled
    base = simulate(c.layout, c.programs, result.costs)
    costs = CostModel.from_json(result.costs.to_json() | {"instr_overhead": 0.01})
    assert CostModel.from_json(costs.to_json()) == costs
    charged = simulate(c.layout, c.programs, costs)
    for r, prog in enumerate(c.programs):
        charges = instruction_charges(prog, 0.01)
        played = [i for i in prog if i.op in COMPUTE_OPS | MEMORY_OPS]
        assert len(charges) == len(played)
        assert sum(charges) == pytest.approx(0.01 * len(prog))
        # Each compute op takes its charge: the rank is busy that much longer.
        assert charged.ranks[r].busy == pytest.approx(base.ranks[r].busy + 0.01 * len(prog))
    assert charged.makespan > base.makespan
    # A compile with the cost writes it into the plan, which prices the build again alike.
    plan = compile_schedule("1f1b", 4, 8, 1, costs).plan
    assert plan["costs"]["instr_overhead"] == 0.01


def test_folding_runs_recovers_the_machine_and_predicts_them():
    raw = synthetic_profile(flat)
    runs = [made_up_run("1f1b"), made_up_run("zb-h1")]
    cal, profile, priced = fold(raw, runs, REQ, conditions=CONDITIONS)
    assert {k: f for _, k, f in cal.factors} == pytest.approx(TRUTH)
    assert cal.instr_s == ((MBS, INSTR_S),) and priced.instr_s == cal.instr_s
    assert list(cal.corrections.values()) == pytest.approx([1.0, 1.0])
    assert cal.model_miss == pytest.approx(0.0, abs=1e-9)
    assert cal.error == MIN_ERROR  # nothing missed, no noise: the floor
    # The calibrated profile is the raw one scaled: per kind at every size (nearest measured).
    for pt, raw_pt in zip(profile.points, raw.points):
        assert pt.seconds[0].W == pytest.approx(raw_pt.seconds[0].W * TRUTH["W"])


def test_a_schedule_the_factors_cannot_explain_is_corrected_by_its_runs():
    runs = [made_up_run("1f1b"), made_up_run("zb-h1", slower=1.1)]
    plan = calibrate(plan_profile(synthetic_profile(flat), REQ), runs, None, CONDITIONS)
    cal = plan.calibration
    corrections = cal.corrections
    assert corrections[("zb-h1 plain", MBS)] / corrections[("1f1b plain", MBS)] == pytest.approx(
        1.1
    )
    by_name = {(e.schedule, e.mbs): e for e in plan.evaluation.fits}
    # A row that ran is priced from its run; the same schedule at another size by the nearest
    # size's correction; interleaved, which did not run, by the median correction.
    assert by_name[("zb-h1", MBS)].iteration_s == pytest.approx(runs[1].iterations[0], rel=1e-9)
    assert cal.correction("zb-h1 plain", 2 * MBS) == corrections[("zb-h1 plain", MBS)]
    median = (corrections[("zb-h1 plain", MBS)] + corrections[("1f1b plain", MBS)]) / 2
    assert cal.correction("interleaved plain", MBS) == pytest.approx(median)
    assert cal.residual == 0.0  # no schedule ran at two sizes: nothing to carry over


def test_a_correction_carried_to_another_size_states_its_miss():
    # 1F1B ran at two sizes and missed by 5% more at one: carried over, the miss is stated.
    runs = [made_up_run("1f1b", mbs=MBS), made_up_run("1f1b", slower=1.05, mbs=2 * MBS)]
    plan = calibrate(plan_profile(synthetic_profile(flat), REQ), runs, None, CONDITIONS)
    assert plan.calibration.residual == pytest.approx(0.05, rel=1e-3)
    assert plan.error == plan.calibration.residual


def test_the_saved_calibration_prices_a_build_as_the_plan_ranked_it(tmp_path):
    raw = synthetic_profile(flat)
    plan = calibrate(plan_profile(raw, REQ), [made_up_run("1f1b"), made_up_run("zb-h1", 1.05)])
    req = plan.request
    saved = saved_mod.SavedProfile(raw, req.comm_s, req.machine, req.instr_s, plan.calibration)
    back = saved_mod.load(saved_mod.save(saved, tmp_path / "p.json"))
    assert back == saved and back.digest == saved.digest
    for ev in plan.evaluation.fits[:4]:
        row = planned_row(back, ev.request, ev.mbs)
        assert row.iteration_s == pytest.approx(ev.iteration_s, rel=1e-12)


def test_rows_within_the_error_are_ties_listed_simplest_first():
    # A run of times each within the error of the one before: one group, however long.
    assert groups([1.0, 1.03, 1.06, 1.2], 0.05) == [0, 0, 0, 3]
    assert groups([1.0, 1.03], None) == [0, 1]
    fits = plan_profile(synthetic_profile(flat), REQ).evaluation.fits
    one = next(e for e in fits if e.schedule == "1f1b" and e.mbs == MBS)
    zb = next(e for e in fits if e.schedule == "zb-h1" and e.mbs == MBS)
    zb = type(zb)(**{**zb.__dict__, "iteration_s": one.iteration_s / 1.03})
    rows, places = ranked([zb, one], 0.05)
    assert [e.schedule for e in rows] == ["1f1b", "zb-h1"] and places == [1, 1]
    rows, places = ranked([zb, one], 0.02)  # beyond the error: the faster first
    assert [e.schedule for e in rows] == ["zb-h1", "1f1b"] and places == [1, 2]
    # Tied through a row between them, 1F1B is still beyond the error of the fastest: it is
    # not the pick, and follows the rows within the error by predicted time.
    mid = type(zb)(**{**zb.__dict__, "iteration_s": one.iteration_s / 1.015})
    rows, places = ranked([one, mid, zb], 0.02)
    assert [e.iteration_s for e in rows] == [zb.iteration_s, mid.iteration_s, one.iteration_s]
    assert places == [1, 1, 1]


def test_the_report_states_the_error_and_the_ties():
    raw = synthetic_profile(flat)
    uncalibrated = plan_profile(raw, REQ)
    text = render_text(uncalibrated)
    assert "uncalibrated" in text and "expected error" not in text
    assert render_json(uncalibrated)["expected_error"] is None
    plan = calibrate(uncalibrated, [made_up_run("1f1b"), made_up_run("zb-h1", 1.01)])
    text = render_text(plan)
    assert f"expected error {plan.error:.1%}" in text and "=1" in text
    out = render_json(plan)
    assert out["expected_error"] == plan.error and out["calibration"]["corrections"]
    tied = [c for c in out["candidates"] if c["place"] == 1]
    assert len(tied) > 1 and all(c["tied"] for c in tied)
    # The simplest of a tie comes first: plain 1F1B, else plain rows by predicted time.
    order = [(c["schedule"] != "1f1b", c["strategy"] != "plain", c["iteration_s"]) for c in tied]
    assert order == sorted(order)


def test_spread_is_the_medians_uncertainty():
    assert spread([1.0]) == 0.0 and spread([2.0] * 9) == 0.0
    noisy = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.2, 0.8]
    assert 0 < spread(noisy) < (max(noisy) - min(noisy)) / 2
    # Turns whose medians drifted apart: half their range, over the median.
    assert spread([2.0] * 9, turns=(1.9, 2.0, 2.1)) == pytest.approx(0.05)


def test_a_run_under_other_conditions_is_told():
    planned = {"conditions": CONDITIONS.to_json()}
    assert notice(planned, CONDITIONS) is None and notice({}, CONDITIONS) is None
    other = Conditions(4, P, "bf16", "2.13.0", "cpu", 2, 3.0)  # the load is not compared
    said = notice(planned, other)
    assert "threads per rank 1 -> 4" in said and "precision fp32 -> bf16" in said
    assert "load" not in said.split("differs")[1]


def test_show_names_the_op_kinds_off_their_costs():
    result = run("zb-h1", 4, 8, None, "F=1,B=2,W=1,comm=0.1")
    c = result.compiled
    slow = {Op.W: 1.3}
    reports = []
    for r, slots in enumerate(result.sim.timeline):
        ops = tuple((s.end - s.start) * slow.get(s.instr.op, 1.0) for s in slots)
        step = (slots[-1].end, sum(ops), slots[0].start, slots[-1].end)
        n = len(c.programs[r])
        reports.append(
            RankReport(r, 0, n, (step,) * 2, ((0, 0),) * 2, (ops,) * 2, (), (), 0.0, "cpu")
        )
    stats = summarize(reports, c, result.costs, "profile", 0)
    assert {op["op"] for op in stats["ops"]} == {"F", "B", "W"}
    ratios = kind_ratios(stats, c, result.costs)
    assert ratios == pytest.approx({"B": 1.0, "F": 1.0, "W": 1.3})
    assert op_kinds_line(ratios).startswith("op kinds off by more than 10%: W (")
    assert "every one within 10%" in op_kinds_line({"F": 1.05})


def test_turns_of_a_run_merge_into_one():
    def turn(ms: float, own: float) -> dict:
        return {
            "ops": [{"op": "F", "stage": 0, "ms": ms, "count": 4}],
            "ranks": [{"rank": 0, "own_us_per_instruction": own, "optimizer_ms": 1.0}],
            "per_step": [{"iteration_ms": ms * 10}],
        }

    merged = merge_turns([turn(1.0, 10.0), turn(3.0, 30.0), turn(2.0, 20.0)])
    assert merged["ops"] == [{"op": "F", "stage": 0, "ms": 2.0, "count": 3}]
    assert merged["ranks"][0]["own_us_per_instruction"] == 20.0
    assert [s["iteration_ms"] for s in merged["per_step"]] == [10.0, 30.0, 20.0]
    assert merged["turn_ms"] == [10.0, 30.0, 20.0]
