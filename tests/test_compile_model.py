"""`pipec compile MODEL`: the frontend's plan drives the costs, memory is reported in bytes, and
`--dp` adds data-parallel gradient sync."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipec.compile import compile_schedule
from pipec.frontend import load_factory, measure_stash_bytes, split_model
from pipec.ir import Op
from pipec.model import compile_model
from pipec.passes.registry import SCHEDULES, family
from pipec.runtime.direct import direct_calls
from tests.test_cli import cli_run

ROOT = Path(__file__).resolve().parents[1]
family("1f1b")  # registers the built-in families


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """The issue's command, from the repository root."""
    out = tmp_path_factory.mktemp("model") / "build"
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)
        code = cli_run(
            "compile",
            "examples/gpt.py:tiny",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "-m",
            "8",
            "--out",
            str(out),
        )
    finally:
        os.chdir(cwd)
    assert code == 0
    return out


def test_compile_model_writes_plan_costs_and_launcher(build):
    names = {p.name for p in build.iterdir()}
    assert {"plan.json", "stats.json", "launch.py", "rank_003.pipe"} <= names
    plan = json.loads((build / "plan.json").read_text())
    model = plan["model"]
    assert model["spec"] == "examples/gpt.py:tiny" and model["n_stages"] == 4
    # The simulator's per-chunk costs are the plan's per-stage seconds, in ms.
    for kind in "FBW":
        assert plan["costs"][kind] == [s["seconds"][kind] * 1000 for s in model["stages"]]
    assert "torchrun --standalone --nproc-per-node 4 launch.py" in (build / "launch.py").read_text()


def test_measured_stash_bytes_per_stage_match_the_simulator(build):
    """Stash bytes measured on each stage (saved-tensor hooks) are what the simulator counts:
    under 1F1B rank r holds p - r stashes of its stage at its peak."""
    plan = json.loads((build / "plan.json").read_text())
    stats = json.loads((build / "stats.json").read_text())
    spec = load_factory(str(ROOT / "examples/gpt.py:tiny"))
    stages = split_model(spec, 4, "balanced")
    x, measured = spec.example_inputs, []
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        loss = (lambda out: spec.loss_fn(out, spec.example_target)) if last else None
        measured.append(measure_stash_bytes(direct_calls(stage), x, loss))  # as it runs
        x = (stage(*x).detach(),)
    assert [s["stash_bytes"] for s in plan["model"]["stages"]] == measured
    assert stats["stash_bytes_per_chunk"] == measured
    for r, rank in enumerate(stats["ranks"]):
        assert rank["peak_activations"] == 4 - r
        assert rank["peak_stash_bytes"] == (4 - r) * measured[r]
    svg = (build / "schedule.svg").read_text()
    assert f"peak 4 stashes = {4 * measured[0] / 2**20:.2f} MiB" in svg  # units and bytes


def test_recomputed_stages_keep_their_measured_input_bytes(build):
    """Under 1F1B-R a stage keeps only its inputs until RECOMPUTE: the model's boundary
    tensors (the first stage's token ids, later ones an activation), not a fixed share."""
    plan = json.loads((build / "plan.json").read_text())
    stages = plan["model"]["stages"]
    batch, seq = stages[0]["inputs"][0]["shape"]
    assert plan["costs"]["input_bytes"] == [batch * seq * 8] + [batch * seq * 64 * 4] * 3
    r = compile_model(str(ROOT / "examples/gpt.py:tiny"), "1f1b-r", 4, 8)
    inputs, stash = plan["costs"]["input_bytes"], plan["costs"]["stash_bytes"]
    # Rank r's peak: p-r-1 kept inputs and one recomputed stash (the backward's).
    assert [x.peak_stash_bytes for x in r.sim.ranks] == [
        (3 - k) * inputs[k] + stash[k] for k in range(4)
    ]


def test_model_errors_are_one_line_exit_2(tmp_path, capsys):
    broken = ROOT / "tests/frontend_models/broken.py:data_dependent_if"
    assert (
        cli_run(
            "compile", str(broken), "-s", "1f1b", "-p", "2", "-m", "2", "-o", str(tmp_path / "b")
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DataDependentIf" in err and "broken.py:" in err
    gpt = str(ROOT / "examples/gpt.py:tiny")
    out = ("-o", str(tmp_path / "b"))
    assert cli_run("compile", gpt, "-s", "1f1b", "-p", "2", "-m", "2", "--costs", "F=2", *out) == 2
    assert "with MODEL give only comm=" in capsys.readouterr().err
    assert cli_run("compile", "-s", "1f1b", "-p", "2", "-m", "2", "--profile", *out) == 2
    assert "need a MODEL" in capsys.readouterr().err
    assert cli_run("compile", "-s", "1f1b", "-p", "2", "-m", "2", "--dp", "0", *out) == 2
    assert "--dp must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_dp_syncs_each_stage_once_after_its_last_backward(name):
    result = compile_schedule(name, 4, 8, dp=2)
    assert result.plan["dp"] == 2 and "dp" not in compile_schedule(name, 4, 8).plan
    layout = result.compiled.layout
    for r, program in enumerate(result.compiled.programs):
        # Data-parallel syncs name no peer (a replica all-reduce of two-way schedules does).
        syncs = [k for k, i in enumerate(program) if i.op is Op.ALLREDUCE_GRADS and i.peer is None]
        assert sorted(program[k].stage for k in syncs) == list(layout.stages_of_rank(r))
        for k in syncs:
            s = program[k].stage
            last = max(
                j for j, i in enumerate(program) if i.stage == s and i.op in (Op.B, Op.W, Op.BW)
            )
            assert last < k
            assert all(program[j].op is Op.ALLREDUCE_GRADS for j in range(last + 1, k))
