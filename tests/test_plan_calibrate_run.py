"""One real calibration run of the tiny GPT on two ranks, then that run folded in again.

`pipec plan`'s calibration run (pipec/plan/calibrate_run.py) trains plain 1F1B under torchrun;
what it measured must reach the plan (factors, the cost per instruction, the link, the
conditions) and its kept build must serve `--calibrate BUILD` and `pipec show`'s check of its
op kinds. Nothing here is timed: only that each figure arrives and is positive.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import cli_run

from pipec.build_dir import MEASURED
from pipec.plan.calibrate_run import calibrate_by_running
from pipec.plan.candidates import PlanRequest
from pipec.plan.driver import plan_model

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
FAST = ["--mbs", "2", "--runs", "1", "--peak-tflops", "1", "--threads", "1"]
ONLY = ["--schedules", "1f1b", "--strategies", "plain"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    keep = tmp_path_factory.mktemp("calibrate")
    req = PlanRequest(2, 4, 2**30, schedules=("1f1b",), strategies=("plain",))
    plan = plan_model(GPT, req, mbs=[2], runs=1, peak_flops=1e12, progress=False)
    return calibrate_by_running(GPT, plan, 1, keep=keep), keep


def test_the_calibration_run_reaches_the_plan(calibrated):
    plan, _ = calibrated
    cal = plan.calibration
    assert {k for n, k, f in cal.factors if n == 2 and f > 0} == {"F", "BW"}
    assert cal.instr_s[0][0] == 2 and cal.instr_s[0][1] > 0
    latency, bandwidth = cal.link
    assert latency >= 0 and bandwidth > 0
    assert (cal.conditions.ranks, cal.conditions.threads) == (2, 1)
    assert [f for _, f, *_ in cal.runs] == ["1f1b plain"] and plan.error >= 0.02
    assert plan.request.instr_s == cal.instr_s and plan.request.machine is not None


def test_a_finished_run_folds_in_and_show_checks_its_op_kinds(calibrated, capsys, tmp_path):
    _, keep = calibrated
    (build,) = (d for d in keep.iterdir() if d.is_dir())
    measured = build / MEASURED
    (measured / "stats_round1.json").rename(measured / "stats.json")  # as a run leaves it
    assert cli_run("show", str(build)) == 0
    assert "op kinds" in capsys.readouterr().out
    argv = ["plan", GPT, "--pp", "2", "-B", "4", "--memory-per-device", "1GiB", *FAST, *ONLY]
    saved = ["--save-profile", str(tmp_path / "p.json")]
    code = cli_run(*argv, "--calibrate", str(build), *saved, "--json")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    (run,) = out["calibration"]["runs"]
    assert run[0] == f"{build} (a run)" and run[1] == "1f1b plain"
    assert out["expected_error"] >= 0.02 and out["candidates"][0]["place"] == 1
