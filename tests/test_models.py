"""Models nobody on the project wrote compile and train unmodified: Hugging Face GPT-2 and Llama
(GQA), a stock nn.TransformerEncoder. `pipec compile MODEL` with 1f1b, v-half and zb-h1 at
p=2, then one training step of every build inside ONE torchrun launch (2 ranks, gloo): every
parameter's gradient, by its name in the model, equals a single-process `loss.backward()`.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipec.cli import main as pipec_main
from pipec.frontend import ModelSpec, build_model_plan, load_factory, split_model
from pipec.runtime.torchrun import torchrun
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
STOCK = Path(__file__).resolve().parent / "frontend_models" / "stock.py"
MODELS = {
    "hf-gpt2": f"{STOCK}:gpt2",
    "hf-llama": f"{ROOT}/examples/hf_llama.py:tiny",
    "encoder": f"{STOCK}:encoder",
    "masked": f"{STOCK}:masked",  # int64 ids and a bool mask cross every cut
}
SCHEDULES = ("1f1b", "v-half", "zb-h1")
P, M = 2, 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Compile every (model, schedule) with the CLI, run them all in one torchrun launch."""
    tmp = tmp_path_factory.mktemp("models")
    cases = {}
    for model, spec in MODELS.items():
        for schedule in SCHEDULES:
            out = tmp / f"{model}-{schedule}"
            argv = ["compile", spec, "-s", schedule, "-p", str(P), "-m", str(M), "-o", str(out)]
            cases[f"{model}/{schedule}"] = (pipec_main(argv), {"kind": "grads"})
    return cases, launch(cases, P, tmp / "run", timeout=420).results


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_step_gives_the_single_process_gradients(launched, model, schedule):
    cases, results = launched
    case = f"{model}/{schedule}"
    for rank, res in enumerate(results):
        assert res[case]["ok"], f"rank {rank}: {res[case]['error']}"
    checked = {n for res in results for n in res[case]["names"]}
    names = load_factory(MODELS[model]).model.named_parameters(remove_duplicate=False)
    assert checked == {n for n, _ in names}
    plan = cases[case][0].plan["model"]
    if schedule == "zb-h1":  # B and W split: the products' weight gradients wait for W
        assert all(s["flops"]["W"] > 0 for s in plan["stages"])


@pytest.mark.parametrize(
    "model, schedule, n_stages", [("hf-llama", "zb-h1", 2), ("hf-gpt2", "v-half", 4)]
)
def test_launch_check_grads_passes_on_hugging_face_builds(tmp_path, model, schedule, n_stages):
    """What a user runs: `launch.py --check-grads` of a build, one torchrun launch each.
    Llama (GQA) with the B/W split; GPT-2 in a V (its tied embedding and head on one rank)."""
    out = tmp_path / "build"
    pipec_main(
        ["compile", MODELS[model], "-s", schedule, "-p", str(P), "-m", str(M), "-o", str(out)]
    )
    cmd, env = torchrun(out / "launch.py", P, "--threads", "1", "--check-grads")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    stages = re.findall(r"stage +(\d+) \(rank \d\): \d+ tensors, max \|diff\| \S+ +ok", run.stdout)
    assert sorted(map(int, stages)) == list(range(n_stages)), run.stdout
    assert "check-grads: ok, every stage matches" in run.stdout


def test_hf_gpt2_ties_the_embedding_and_head_across_the_cut():
    plan = build_model_plan(MODELS["hf-gpt2"], 2, "uniform", progress=False)
    assert plan.tied == (((0, "transformer.wte.weight"), (1, "lm_head.weight")),)


def test_explicit_split_points_pick_the_stages():
    plan = build_model_plan(
        MODELS["hf-llama"], 3, split_points=("layers.1", "model.layers.3"), progress=False
    )
    assert plan.partition == (1, 2, 1) and plan.partition_mode == "explicit"
    spec = replace(load_factory(MODELS["hf-llama"]), split_points=("layers.3",))
    assert build_model_plan(spec, 2, progress=False).partition == (3, 1)


def test_split_points_on_the_command_line(tmp_path):
    argv = ["compile", MODELS["hf-llama"], "-s", "1f1b", "-p", "2", "-m", "4"]
    result = pipec_main([*argv, "--split-points", "layers.1", "-o", str(tmp_path / "b")])
    assert result.plan["model"]["partition"] == {"mode": "explicit", "blocks_per_stage": [1, 3]}


def test_what_crosses_a_cut_keeps_its_dtype():
    plan = build_model_plan(MODELS["masked"], 4, "uniform", progress=False)
    for stage in plan.stages[1:]:
        assert [t.dtype for t in stage.inputs] == ["int64", "bool", "float32"]


@pytest.mark.parametrize("model", ["hf-gpt2", "hf-llama", "encoder"])
def test_models_fx_cannot_take_are_exported(model):
    assert build_model_plan(MODELS[model], 2, "uniform", progress=False).capture == "export"


BROKEN = Path(__file__).resolve().parent / "frontend_models" / "broken.py"


@pytest.mark.parametrize(
    "model, extra, expected",
    [
        (
            f"{BROKEN}:returns_nothing",
            [],
            (
                "loss_fn raised AttributeError: 'NoneType' object has no attribute 'logits' "
                "(ReturnsNothing.forward returned None)"
            ),
        ),
        (f"{BROKEN}:data_dependent_if", [], "control flow depends on a traced value"),
        (
            MODELS["hf-llama"],
            ["--split-points", "layers.9"],
            "split point 'layers.9' names no block of model.layers",
        ),
        (
            MODELS["hf-llama"],
            ["--split-points", "layers.1,layers.2"],
            "2 split points make 3 stages, but the schedule has 2 (p·v)",
        ),
        (
            MODELS["hf-llama"],
            ["--split-points", "layers.2,layers.1,layers.3", "-v", "2"],
            (
                "split point 'layers.1' comes after 'layers.2': split points must name blocks in "
                "increasing order"
            ),
        ),
        (MODELS["hf-llama"], ["-p", "8"], "cannot split 4 blocks into 8 stages"),
    ],
)
def test_bad_models_and_split_points_are_one_line_exit_2(tmp_path, capsys, model, extra, expected):
    out = tmp_path / "out"
    schedule = "interleaved" if "-v" in extra else "1f1b"
    argv = ["compile", model, "-s", schedule, "-p", "2", "-m", "4", "-o", str(out), *extra]
    with pytest.raises(SystemExit) as e:
        pipec_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("pipec: error: ")
    assert expected in err
    assert not out.exists()


class TupleOut(torch.nn.Module):
    """A forward returning a tuple (the loss reads its first element)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x, x.sum()


@pytest.mark.parametrize(
    "factory",
    [
        lambda: load_factory(f"{STOCK}:sequential"),
        lambda: ModelSpec(
            TupleOut(), (torch.randn(2, 8),), torch.randn(2, 8), lambda out, y: (out[0] - y).var()
        ),
    ],
    ids=["sequential", "tuple-output"],
)
@pytest.mark.parametrize("capture", ["auto", "export"])
def test_stages_chain_to_the_models_output_as_it_returns_it(factory, capture):
    spec = replace(factory(), capture=capture)
    stages = split_model(spec, 2, "uniform")
    x = spec.example_inputs
    out = stages[1](*((y,) if isinstance(y := stages[0](*x), torch.Tensor) else y))
    want = spec.model(*x)
    assert type(out) is type(want)
    torch.testing.assert_close(out, want)
    assert build_model_plan(spec, 2, "uniform", progress=False).stages[1].params > 0
