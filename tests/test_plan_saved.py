"""From a plan's row to its build: the saved profile, and `pipec compile --plan-profile`.

The synthetic profile has the tiny GPT's eight blocks, so rows planned on it build for the real
model (its factory takes the micro-batch size) without profiling anything here.
"""

import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from plan_synthetic import synthetic_profile
from test_cli import cli_run

from pipec.build_dir import load
from pipec.compile import compile_schedule
from pipec.ir import PipecError
from pipec.passes.memory_bytes import for_device, predict_peaks
from pipec.passes.simulate import simulate
from pipec.plan import saved as saved_mod
from pipec.plan.build import command_line
from pipec.plan.candidates import PlanRequest, evaluate_one
from pipec.plan.driver import machine, plan_profile
from pipec.plan.memory import byte_facts
from pipec.plan.saved import SavedProfile

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
P, BATCH, BUDGET = 4, 64, 85_000  # eviction unlocks mbs 8 (test_plan_candidates.py)
LINKS = "intra=1e9:1e-5,inter=1e8:1e-4"


def rising(n: int) -> float:
    return min(0.05 * n, 0.8)


@pytest.fixture(scope="module")
def plans():
    """Plans on the synthetic profile: every family; and three on a 2-node machine."""
    full = PlanRequest(P, BATCH, BUDGET)
    linked = replace(
        full, machine=machine(P, 2, 2, LINKS), schedules=("1f1b", "zb-v", "interleaved")
    )
    return {links: plan_profile(synthetic_profile(rising), req) for links, req in
            ((False, full), (True, linked))}  # fmt: skip


@pytest.mark.parametrize("links", [False, True])
def test_evaluate_one_is_the_row_the_plan_ranked(plans, links):
    plan = plans[links]
    req, ev = plan.request, plan.evaluation
    rows = ev.fits + ev.over
    assert {e.strategy for e in rows} == {"plain", "recompute", "evict"}
    for row in rows:
        assert evaluate_one(plan.profile, row.request, row.mbs, req.comm_s, req.machine) == row


def test_a_saved_profile_reads_back_equal(tmp_path, plans):
    plan = plans[True]
    saved = SavedProfile(plan.profile, 0.0, plan.request.machine)
    path = saved_mod.save(saved, tmp_path / "p.json")
    assert saved_mod.load(path) == saved and saved_mod.load(path).digest == saved.digest
    assert saved_mod.default_path(saved) == Path(f"plan-profile-{saved.digest}.json")
    beside = saved_mod.default_path(saved, Path("build/tiny"))  # a build holds only its files
    assert beside == Path(f"build/plan-profile-{saved.digest}.json")
    other = replace(saved, profile=replace(saved.profile, peak_flops=2e9))
    assert other.digest != saved.digest


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not JSON"),
        ('{"format": "other"}', "not a profile `pipec plan` wrote"),
        ('{"format": "pipec.plan_profile/3", "comm_s": 0}', "corrupted (KeyError"),
        ('{"format": "pipec.plan_profile/2"}', "written by another version of pipec plan"),
    ],
)
def test_a_bad_profile_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(PipecError, match=re.escape(message)):
        saved_mod.load(path)


def pick(plan, strategy: str, schedule: str | None = None):  # type: ignore[no-untyped-def]
    return next(
        e
        for e in plan.evaluation.fits
        if e.strategy == strategy and (schedule is None or e.schedule == schedule)
    )


@pytest.mark.parametrize(
    "strategy, schedule, links",
    [
        ("evict", "1f1b", False),
        ("recompute", None, False),
        ("plain", "zb-v", True),
        ("plain", "interleaved", True),
    ],
)
def test_the_command_line_builds_the_programs_the_plan_simulated(
    tmp_path, plans, strategy, schedule, links
):
    plan = plans[links]
    ev = pick(plan, strategy, schedule)
    saved = saved_mod.save(SavedProfile(plan.profile, 0.0, plan.request.machine), tmp_path / "p")
    argv = command_line(ev, GPT, saved, 1, tmp_path / "b")
    assert argv[:2] == ["pipec", "compile"]
    assert cli_run(*argv[1:]) == 0
    build = load(tmp_path / "b")
    job = ev.request
    simulated = compile_schedule(
        job.schedule, job.p, job.m, job.v, ev.costs, job.memory_limit, **dict(job.options)
    )
    assert build.compiled.programs == simulated.compiled.programs
    # Priced in ms rather than seconds, the build simulates and predicts as the plan did.
    sim = simulate(build.compiled.layout, build.compiled.programs, build.costs)
    assert [r.peak_stash_bytes for r in sim.ranks] == [
        r.peak_stash_bytes for r in simulated.sim.ranks
    ]
    facts, ahead = for_device(byte_facts(ev.chunks), plan.profile.device)
    c = build.compiled
    assert predict_peaks(c.layout, c.programs, build.costs, sim, facts, ahead) == ev.memory
    model = build.plan["model"]
    assert model["micro_batch_size"] == ev.mbs
    assert model["partition"]["blocks_per_stage"] == list(ev.chunks.counts)
    assert model["planned"]["iteration_s"] == ev.iteration_s
    assert model["planned"]["peak_bytes"] == ev.peak_bytes


def test_dp_copies_add_the_gradient_all_reduce_and_nothing_else(tmp_path, plans):
    plan = plans[False]
    ev = pick(plan, "plain", "1f1b")
    saved = saved_mod.save(SavedProfile(plan.profile), tmp_path / "p")
    assert cli_run(*command_line(ev, GPT, saved, 1, tmp_path / "one")[1:]) == 0
    assert cli_run(*command_line(ev, GPT, saved, 2, tmp_path / "two")[1:]) == 0
    one, two = load(tmp_path / "one"), load(tmp_path / "two")
    assert two.plan["dp"] == 2
    for a, b in zip(one.compiled.programs, two.compiled.programs, strict=True):
        assert [i for i in b if i.op.name != "ALLREDUCE_GRADS"] == list(a)


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--plan-profile needs --micro-batch-size"),
        (["--micro-batch-size", "3"], "micro-batch size 3 was not profiled"),
        (["--micro-batch-size", "2", "--partition", "uniform"], "drop --partition"),
        (["--micro-batch-size", "2", "--costs", "comm=1"], "drop --costs"),
        (["--micro-batch-size", "2", "--memory-limit", "1GiB"], "a --memory-limit in bytes"),
    ],
)
def test_plan_profile_refusals_are_one_line(tmp_path, capsys, extra, message):
    saved = saved_mod.save(SavedProfile(synthetic_profile(rising)), tmp_path / "p")
    argv = ["compile", GPT, "-s", "1f1b", "-p", "4", "-m", "8", "--plan-profile", str(saved)]
    assert cli_run(*argv, *extra, "-o", str(tmp_path / "b")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "b").exists()


def test_a_profile_priced_for_one_machine_refuses_another_pipeline(tmp_path, capsys):
    saved = SavedProfile(synthetic_profile(rising), 0.0, machine(P, 2, 2, LINKS))
    saved = saved_mod.save(saved, tmp_path / "p")
    argv = ["compile", GPT, "-s", "1f1b", "-p", "2", "-m", "8", "--micro-batch-size", "2"]
    assert cli_run(*argv, "--plan-profile", str(saved), "-o", str(tmp_path / "b")) == 2
    assert "prices links for 4 ranks" in capsys.readouterr().err


def test_every_json_row_carries_the_command_that_builds_it(tmp_path, capsys):
    # A real plan: the tiny GPT profiled at two sizes. Each row's command, run as printed,
    # builds that row: the build records the row's predicted time and memory.
    profile = tmp_path / "profile.json"
    code = cli_run(
        "plan", GPT, "--pp", "2", "--global-batch", "8", "--memory-per-device", "1GiB",
        "--mbs", "2,4", "--runs", "1", "--peak-tflops", "0.1", "--threads", "1",
        "--schedules", "1f1b,zb-v", "--save-profile", str(profile), "--json",
        "--no-calibration-run",
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert saved_mod.load(profile).profile.factory_sized and out["profile_factory_sized"]
    rows = out["candidates"]
    for row in (*rows, out["baseline"], *out["over_budget"]):
        argv = shlex.split(row["command"])
        assert argv[:3] == ["pipec", "compile", GPT] and argv[-2:] == ["--out", "build"]
        assert argv[argv.index("--plan-profile") + 1] == str(profile)
    for k, row in enumerate(rows[:3]):
        argv = shlex.split(row["command"])[1:-2]
        assert cli_run(*argv, "--out", str(tmp_path / str(k))) == 0
        built = load(tmp_path / str(k)).plan["model"]["planned"]
        assert (built["iteration_s"], built["peak_bytes"]) == (
            row["iteration_s"],
            row["peak_bytes"],
        )
        assert (built["schedule"], built["strategy"], built["mbs"]) == (
            row["schedule"],
            row["strategy"],
            row["mbs"],
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pick", "2"], "--pick chooses the row --out builds"),
        (["--out", "{tmp}"], "holds files that are not a pipec build"),
    ],
)
def test_plan_out_refusals_come_before_profiling(tmp_path, capsys, args, message):
    (tmp_path / "taken").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    argv = ["plan", GPT, "--pp", "2", "--global-batch", "8", "--memory-per-device", "1GiB"]
    assert cli_run(*argv, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_pick_past_the_rows_is_one_line_and_builds_nothing(tmp_path, capsys):
    factory = f"{ROOT}/tests/plan_factories.py:sized"  # four small blocks: profiled at once
    out = tmp_path / "b"
    code = cli_run(
        "plan", factory, "--pp", "2", "--global-batch", "4", "--mbs", "2",
        "--memory-per-device", "1GiB", "--schedules", "1f1b", "--strategies", "plain",
        "--runs", "1", "--peak-tflops", "0.1", "--threads", "1",
        "--save-profile", str(tmp_path / "p.json"), "--out", str(out), "--pick", "2",
        "--no-calibration-run",
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2
    assert (
        captured.err.splitlines()[-1] == "pipec: error: --pick 2: 1 candidate(s) fit; pick 1 to 1"
    )
    assert not out.exists() and "1* 1f1b" in captured.out  # the table came first
