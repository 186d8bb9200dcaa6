"""`pipec plan` on the tiny GPT on this CPU: measures what it claims."""

import json

import pytest
from test_cli import cli_run

GPT = "examples/gpt.py:tiny"


@pytest.mark.parametrize("p", [2, 4])
def test_plan_on_the_tiny_gpt(p, capsys, tmp_path):
    code = cli_run(
        "plan",
        GPT,
        "--pp",
        str(p),
        "--global-batch",
        "32",
        "--memory-per-device",
        "64MiB",
        "--threads",
        "1",
        "--time-budget",
        "15",
        "--runs",
        "2",
        "--save-profile",
        str(tmp_path / "profile.json"),
        "--json",
        "--no-calibration-run",
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert "measured" in out["peak_source"] and out["candidates"]
    assert (
        out["baseline"]["schedule"] == "1f1b"
        and out["baseline"]["m"] * out["baseline"]["mbs"] == 32
    )
    assert out["candidates"][0]["iteration_s"] == min(c["iteration_s"] for c in out["candidates"])
    for c in out["candidates"]:
        assert c["peak_bytes"] <= 64 * 2**20 and len(c["memory"]) == p
    # Stash bytes scale linearly with the micro-batch size (the memory model relies on it).
    profile = out["profile"]
    per_sample = [pt["stash_bytes"] / pt["mbs"] for pt in profile]
    assert len(profile) >= 3 and max(per_sample) / min(per_sample) < 1.02


def test_plan_names_the_smallest_budget_when_nothing_fits(capsys):
    code = cli_run(
        "plan",
        GPT,
        "--pp",
        "2",
        "--global-batch",
        "8",
        "--memory-per-device",
        "100KiB",
        "--mbs",
        "1",
        "--runs",
        "1",
        "--peak-tflops",
        "0.1",
        "--threads",
        "1",
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(
        "pipec: error: --memory-per-device 100 KiB fits no candidate; "
        "the smallest that fits one is "
    )


def test_plan_prices_transfers_on_the_machine_given(capsys, tmp_path):
    link = "intra=100e9:5e-6,inter=1e9:1e-4"
    code = cli_run(
        "plan", GPT, "--pp", "2", "--global-batch", "4", "--memory-per-device", "1GiB",
        "--mbs", "1,2", "--runs", "1", "--peak-tflops", "0.1", "--threads", "1",
        "--nodes", "2", "--gpus-per-node", "1", "--link", link, "--json",
        "--save-profile", str(tmp_path / "profile.json"), "--no-calibration-run",
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    machine = json.loads(captured.out)["machine"]
    assert (machine["nodes"], machine["gpus_per_node"]) == (2, 1)
    assert machine["inter"] == {"bandwidth": 1e9, "latency": 1e-4}
    # The saved profile keeps the machine: its rows' command lines price links as the plan did.
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["machine"] == machine


@pytest.mark.parametrize(
    "args, message",
    [
        (["--global-batch", "30", "--dp", "4"], "--global-batch 30 is not divisible by --dp 4"),
        (["--global-batch", "8", "--memory-per-device", "lots"], "--memory-per-device 'lots'"),
        (["--global-batch", "8", "--mbs", "3"], "--mbs 3 does not divide"),
        (["--global-batch", "8", "--strategies", "teleport"], "unknown strategy 'teleport'"),
        (["--global-batch", "8", "--nodes", "2"], "--nodes/--gpus-per-node price transfers"),
        (["-B", "8", "--nodes", "3", "--link", "intra=1e9:0"], "--nodes 3 x --gpus-per-node 0"),
    ],
)
def test_bad_input_is_one_line_before_any_profiling(args, message, capsys, monkeypatch):
    opts = {"--memory-per-device": "1GiB"}
    argv = ["plan", GPT, "--pp", "2", *args]
    argv += [f"{k}={v}" for k, v in opts.items() if k not in args]

    def never(*args, **kw):
        raise AssertionError("profiled before checking the input")

    monkeypatch.setattr("pipec.plan.profile_mbs.profile_model", never)
    assert cli_run(*argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
