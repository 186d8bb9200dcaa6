"""Models whose blocks sit in several stacks: a torchvision-style ResNet (a stem, then
layer1..3) and Hugging Face T5 (encoder and decoder) are cut across all their stacks, balanced
by counted FLOPs; `compile` and `show` print the partition; too few blocks is refused before any
capture; `--check-grads` passes on both and on a model with dropout (checked with dropout off,
as it prints), all builds in ONE torchrun launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import pipec.frontend.plan
from pipec.cli import main as pipec_main
from pipec.codegen.partition import partition_text
from pipec.frontend import FrontendError, ModelPlan, ModelSpec, build_model_plan
from pipec.frontend.blocks import find_blocks
from tests.runtime_launch import launch

MODELS = Path(__file__).resolve().parent / "frontend_models" / "stacks.py"
WORKER = Path(__file__).resolve().parent / "check_grads_worker.py"
STACKS = {
    "resnet": (("layer1", 4), ("layer2", 4), ("layer3", 4)),
    "t5": (("encoder.block", 4), ("decoder.block", 4)),
}


def _compile(tmp: Path, model: str, p: int, schedule: str = "1f1b"):  # type: ignore[no-untyped-def]
    argv = ["compile", f"{MODELS}:{model}", "-s", schedule, "-p", str(p), "-m", "4"]
    return pipec_main([*argv, "-o", str(tmp / f"{model}-{p}")])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every (model, p) compiled once by the CLI: (result, what compile printed)."""
    tmp = tmp_path_factory.mktemp("stacks")
    return tmp, {(model, p): _compile(tmp, model, p) for model in STACKS for p in (2, 4)}


@pytest.mark.parametrize("model", STACKS)
@pytest.mark.parametrize("p", [2, 4])
def test_every_stack_is_cut_and_balanced_by_counted_flops(built, model, p):
    plan = built[1][model, p].plan["model"]
    stacks = [(s["path"], s["count"]) for s in plan["blocks"]["stacks"]]
    assert tuple(stacks) == STACKS[model]
    totals = [sum(s["flops"].values()) for s in plan["stages"]]
    assert max(totals) / min(totals) <= 1.5
    assert sum(plan["partition"]["blocks_per_stage"]) == sum(n for _, n in stacks)
    assert ModelPlan.from_json(plan).to_json() == {k: v for k, v in plan.items() if k != "factory"}


def test_compile_and_show_print_the_partition(built, capsys):
    tmp, _ = built
    _compile(tmp / "again", "t5", 4)
    compiled = capsys.readouterr().out.splitlines()
    partition = compiled[1:6]
    assert partition[0] == "blocks: encoder.block.0-3, decoder.block.0-3 (8), balanced, 4 stages"
    assert [line.split(":")[1].split()[0] for line in partition[1:]] == [
        "encoder.block.0-1", "encoder.block.2-3", "decoder.block.0-1", "decoder.block.2-3"
    ]  # fmt: skip
    shares = [float(line.split()[5].rstrip("%")) for line in partition[1:]]
    assert sum(shares) == pytest.approx(100, abs=0.3)
    # T5's LM head is its shared embedding, which both stacks embed with: one parameter
    assert compiled[6] == (
        "  tied: encoder.embed_tokens.weight (stage 0) = decoder.embed_tokens.weight (stage 1) "
        "= lm_head.weight (stage 3): one parameter, its gradients summed each step"
    )
    pipec_main(["show", str(tmp / "again" / "t5-4"), "--lines", "1"])
    shown = capsys.readouterr().out.splitlines()
    assert shown[1:7] == compiled[1:7]
    predicted = shown.index("peak bytes per rank, predicted (by term); a run adds the real peaks:")
    rows = [line.split() for line in shown[predicted + 2 : predicted + 6]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and all(r[3] == "-" for r in rows)


def test_split_points_name_blocks_of_any_stack():
    plan = build_model_plan(f"{MODELS}:t5", 2, split_points=("decoder.block.0",), progress=False)
    assert plan.partition == (4, 4) and plan.partition_mode == "explicit"
    assert plan.stages[1].blocks == (4, 8)


class Block(nn.Module):
    """A composite block holding a stack of its own (a mixture's experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)


class Zipped(nn.Module):
    """Two stacks whose calls interleave (`zip(self.attns, self.mlps)`) and a Sequential of
    blocks between distinct layers."""

    def __init__(self) -> None:
        super().__init__()
        self.attns = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.mlps = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.tail = nn.Sequential(nn.Linear(4, 4), Block(), Block(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, mlp in zip(self.attns, self.mlps):
            x = mlp(attn(x))
        return self.tail(x)


def test_stacks_are_outermost_and_ordered_as_the_forward_runs_them():
    model = Zipped()
    assert find_blocks(model).stacks == (("attns", 3), ("mlps", 3), ("tail", 4))
    spec = ModelSpec(model, (torch.randn(2, 4),), torch.randn(2, 4), nn.functional.mse_loss)
    plan = build_model_plan(spec, 2, "uniform", progress=False)
    assert plan.stacks == (("attns", 3), ("tail", 4))  # interleaved: the first of equals
    assert plan.partition == (4, 3)


def test_a_stem_of_distinct_layers_is_no_stack():
    with pytest.raises(FrontendError) as e:
        build_model_plan(f"{MODELS}:stem_only", 1, progress=False)
    assert "StemOnly has no repeated blocks to split between (found stem: Sequential of " in str(
        e.value
    )
    assert "Conv2d, BatchNorm2d, ReLU" in str(e.value)


def test_too_few_blocks_is_refused_before_capture(tmp_path, capsys, monkeypatch):
    def no_capture(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("captured a model whose blocks were known too few")

    monkeypatch.setattr(pipec.frontend.plan, "export", no_capture)
    monkeypatch.setattr(pipec.frontend.plan, "trace", no_capture)
    out = tmp_path / "out"
    argv = ["compile", f"{MODELS}:dropout", "-s", "zb-v", "-p", "4", "-m", "8", "-o", str(out)]
    with pytest.raises(SystemExit) as e:
        pipec_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err == (
        "pipec: error: cannot split 6 blocks into 8 stages (blocks.0-5): v=2 stages on each "
        "rank, so they fit at most p=3 (asked p=4)\n"
    )
    assert not out.exists()


@pytest.mark.slow
def test_check_grads_passes_on_stacks_and_with_dropout(built, tmp_path):
    """ResNet (BatchNorm: statistics per micro-batch in both), T5 at p=2, and a model with
    dropout 0.1 at zb-v: launch.py's --check-grads, every build in one torchrun launch."""
    _, results = built
    cases = {
        "resnet": (results["resnet", 2], {}),
        "t5": (results["t5", 2], {}),
        "dropout": (_compile(tmp_path, "dropout", 2, "zb-v"), {}),
    }
    launched = launch(cases, 2, tmp_path / "run", timeout=420, script=WORKER)
    for name in cases:
        for rank, res in enumerate(launched.results):
            assert res[name]["ok"], f"{name}, rank {rank}: {res[name]}"
        report = launched.results[0][name]["stdout"]
        assert "check-grads: ok, every stage matches" in report, report
        dropped = "check-grads: dropout off in both" in report
        assert dropped == (name == "dropout"), report


def test_many_stages_print_the_partition_in_one_line():
    stages = [
        {"stage": k, "blocks": [k, k + 1], "flops": {"F": 1, "B": 2, "W": 1}} for k in range(20)
    ]
    model = {
        "blocks": {"path": "layers", "count": 20},
        "partition": {"mode": "uniform", "blocks_per_stage": [1] * 20},
        "stages": stages,
    }
    counts = ",".join(["1"] * 20)
    assert partition_text(model, None).splitlines() == [  # type: ignore[arg-type]
        "blocks: layers.0-19 (20), uniform, 20 stages",
        f"  blocks per stage {counts}; F+B+W FLOPs per stage 5.0% to 5.0% of the model's",
    ]


SWIN = f"{Path(__file__).resolve().parent / 'frontend_models' / 'hf.py'}:swin"


def test_stacks_of_stacks_are_cut_inside_when_that_balances_them():
    """Hugging Face Swin: four stages of 2, 2, 6 and 2 layers. Cut at the stages, p=4 puts 49%
    of the FLOPs on one; one level down, among the 12 layers, no stage holds over 35%."""
    plan = build_model_plan(SWIN, 4, progress=False).to_json()
    inner = [(f"swin.swin.encoder.layers.{i}.blocks", n) for i, n in enumerate((2, 2, 6, 2))]
    assert [(s["path"], s["count"]) for s in plan["blocks"]["stacks"]] == inner
    totals = [sum(s["flops"].values()) for s in plan["stages"]]
    assert max(totals) / sum(totals) <= 0.35
    assert plan["partition"]["mode"] == "balanced"


def test_a_split_point_may_name_a_block_one_level_down():
    plan = build_model_plan(
        SWIN, 2, split_points=["swin.encoder.layers.2.blocks.3"], progress=False
    ).to_json()
    assert plan["partition"] == {"mode": "explicit", "blocks_per_stage": [7, 5]}
    outer = build_model_plan(SWIN, 2, split_points=["layers.2"], progress=False).to_json()
    assert outer["blocks"] == {"path": "swin.swin.encoder.layers", "count": 4}
    with pytest.raises(FrontendError, match="names no block"):
        build_model_plan(SWIN, 2, split_points=["layers.2.blocks.9"], progress=False)
