"""`pipec plan --out`: the ranked row built in one step, trained under ONE torchrun launch.

The tiny GPT (its factory takes the micro-batch size) is planned at micro-batch size 4, twice
its factory's own, under a budget half a stash below plain 1F1B's rank 0, with the two
memory-saving strategies only: BPipe eviction and recomputation. `--out` builds row 1; the
other row is built from its `--json` command line. Both train one step with gradients equal to
one process; both then train two steps, whose measured real peak (`OUT/measured/stats.json`)
is the plan's predicted peak within 10% on every rank, and a run of the first puts the plan's
prediction beside the measured iteration time in `pipec show`.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path

import pytest
from test_cli import cli_run

from pipec.build_dir import load
from pipec.ir import Op
from pipec.plan.saved import load as load_saved
from tests.runtime_launch import run_cases

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"  # micro-batches of 2 unless asked
P, MBS, BATCH = 4, 4, 16
FAST = ["--runs", "1", "--peak-tflops", "1", "--threads", "1", "--time-budget", "30"]
FAST += ["--no-calibration-run"]  # the op times are not what these tests check
STEPS = 2

pytestmark = pytest.mark.slow


def pipec(*args: str) -> str:
    """Run the CLI in this process; its standard output (it must succeed)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_run(*args)
    assert code == 0, err.getvalue()
    return out.getvalue()


def plan(tmp: Path, name: str, budget: str, strategies: str, *extra: str) -> dict:
    argv = ["plan", GPT, "--pp", str(P), "--global-batch", str(BATCH), "--mbs", str(MBS)]
    argv += ["--schedules", "1f1b", "--strategies", strategies, "--memory-per-device", budget]
    argv += ["--save-profile", str(tmp / f"{name}.profile.json"), *FAST, *extra, "--json"]
    return json.loads(pipec(*argv))


def budget_for_eviction(plain_row: dict, profile: Path) -> int:
    """Half a stash of chunk 0 below plain 1F1B's predicted peak on rank 0, where it holds
    4 stashes: plain 1F1B does not fit, eviction and recomputation do."""
    stash = load_saved(profile).profile.chunks(P, MBS).stash_bytes[0]
    return plain_row["memory"][0]["total"] - stash // 2


def with_out(command: str, out: Path) -> list[str]:
    """A printed `pipec compile` command line (after `pipec`) with another --out."""
    argv = shlex.split(command)
    assert argv[:2] == ["pipec", "compile"] and argv[-2] == "--out"
    return [*argv[1:-1], str(out)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan_out")
    plain = plan(tmp, "plain", "1GiB", "plain")["candidates"][0]
    budget = str(budget_for_eviction(plain, tmp / "plain.profile.json"))
    report = plan(tmp, "saving", budget, "evict,recompute", "--out", str(tmp / "first"))
    rows = report["candidates"]
    assert {r["strategy"] for r in rows} == {"evict", "recompute"}
    # Row 1 was built by --out; row 2 is built from its --json command line.
    pipec(*with_out(rows[1]["command"], tmp / "second"))
    cases = [
        {"name": "first", "build": str(tmp / "first"), "kind": "grads"},
        {"name": "second", "build": str(tmp / "second"), "kind": "grads"},
        {"name": "train", "build": str(tmp / "first"), "kind": "train", "steps": STEPS, "lr": 1e-3},
        {
            "name": "train2",
            "build": str(tmp / "second"),
            "kind": "train",
            "steps": STEPS,
            "lr": 1e-3,
        },
    ]
    ranks = run_cases(cases, P, tmp, timeout=300).results
    return tmp, report, ranks


def test_the_build_is_the_printed_compile_command(built):
    tmp, report, _ = built
    assert report["build"]["pick"] == 1
    pipec(*with_out(report["build"]["command"], tmp / "again"))
    first = sorted(f.name for f in (tmp / "first").iterdir() if f.is_file())
    again = sorted(f.name for f in (tmp / "again").iterdir())
    assert first == again and "plan.json" in first and "rank_003.pipe" in first
    for name in first:
        assert (tmp / "first" / name).read_bytes() == (tmp / "again" / name).read_bytes(), name


def test_the_rows_are_built_at_their_micro_batch_size_as_planned(built):
    tmp, report, _ = built
    for name, row in zip(("first", "second"), report["candidates"], strict=True):
        build = load(tmp / name)
        model = build.plan["model"]
        assert model["micro_batch_size"] == MBS and row["mbs"] == MBS
        assert model["stages"][0]["inputs"][0]["shape"] == [MBS, 32]
        assert model["planned"]["iteration_s"] == row["iteration_s"]
        ops = {i.op for program in build.compiled.programs for i in program}
        wanted = {"evict": {Op.EVICT, Op.ACCEPT}, "recompute": {Op.RECOMPUTE}}[row["strategy"]]
        assert wanted <= ops, (row["strategy"], ops)


@pytest.mark.parametrize("case", ["first", "second"])
def test_evict_and_recompute_rows_train_with_single_process_gradients(built, case):
    _, _, ranks = built
    for rank, result in enumerate(ranks):
        assert result[case]["ok"], (rank, result[case])  # assert_close on every parameter
        assert result[case]["names"], rank


def test_show_puts_the_planned_iteration_beside_the_measured_one(built):
    tmp, report, ranks = built
    losses = ranks[0]["train"]
    assert losses["losses"] == pytest.approx(losses["reference"], rel=1e-4)
    stats = json.loads((tmp / "first" / "measured" / "stats.json").read_text())
    shown = pipec("show", str(tmp / "first"), "--lines", "1").splitlines()
    row = report["candidates"][0]
    predicted, measured = row["iteration_s"] * 1e3, stats["measured"]["iteration_ms"]
    assert shown[-2] == (
        f"plan ({row['schedule']} {row['strategy']}, mbs {MBS}): iteration {predicted:.2f} ms "
        f"predicted vs {measured:.2f} ms measured (x{measured / predicted:.2f}; uncalibrated)"
    )
    # The plan's times were taken by the block profile, one process alone; the run had P ranks.
    assert shown[-1].startswith("warning: the plan's times were measured with ")
    assert f"ranks 1 -> {P}" in shown[-1]


@pytest.mark.parametrize("k, name", [(0, "first"), (1, "second")])
def test_the_measured_real_peaks_are_the_plans_within_10_percent(built, k, name):
    # What the plan printed for the row against what the build's run measured: the meter's
    # real peak of the step after the first (runtime/meter.py), per rank.
    tmp, report, _ = built
    row = report["candidates"][k]
    stats = json.loads((tmp / name / "measured" / "stats.json").read_text())
    assert [r["rank"] for r in stats["ranks"]] == list(range(P))
    for planned, measured in zip(row["memory"], stats["ranks"], strict=True):
        real, predicted = measured["real_peak_bytes"], planned["total"]
        assert abs(real - predicted) <= 0.10 * predicted, (name, planned, real)
    assert (
        row["peak_bytes"] == max(r["total"] for r in row["memory"]) <= report["memory_per_device"]
    )
