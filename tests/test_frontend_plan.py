"""The model plan: stage facts, JSON, measured stash, profiling, rebuilding stages for the
runtime."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from examples.gpt import TINY, GPTConfig
from examples.gpt import make_spec as gpt_spec
from pipec import checkpoint
from pipec.frontend import (
    FrontendError,
    ModelPlan,
    build_model_plan,
    build_stages,
    load_factory,
    measure_stash_bytes,
    split_model,
)

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
TWICE_NAMED = {  # models that name a tensor twice, whose graphs read one of the names
    "bert": f"{ROOT}/tests/frontend_models/hf.py:bert",
    "t5": f"{ROOT}/tests/frontend_models/stacks.py:t5",
}


@pytest.fixture(scope="module")
def gpt_plan():
    return build_model_plan(GPT, 4, "uniform")


def test_plan_facts(gpt_plan):
    plan = gpt_plan
    assert (plan.n_stages, plan.p, plan.v, plan.replicas) == (4, 4, 1, 1)
    assert plan.partition == (2, 2, 2, 2) and plan.blocks_path == "blocks"
    assert [s.blocks for s in plan.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    first, middle, last = plan.stages[0], plan.stages[1], plan.stages[-1]
    assert [(t.shape, t.dtype) for t in first.inputs] == [((2, 32), "int64")]
    assert [(t.shape, t.dtype) for t in middle.inputs] == [((2, 32, 64), "float32")]
    assert [(t.shape, t.dtype) for t in last.outputs] == [((2, 32, 128), "float32")]
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert a.outputs == b.inputs
    spec = load_factory(GPT)
    assert sum(s.params for s in plan.stages) == sum(p.numel() for p in spec.model.parameters())
    assert all(s.param_bytes == 4 * s.params for s in plan.stages)
    # Estimated costs: the paper's ordering W < F < B per stage; the LM head makes the last
    # stage the most expensive; seconds are FLOPs at the stated throughput.
    for s in plan.stages:
        assert 0 < s.flops.W < s.flops.F < s.flops.B
        assert s.seconds.F == s.flops.F / plan.flops_per_s
    assert last.flops.F > middle.flops.F
    assert plan.cost_source == "estimate" and plan.tied == ()


def test_plan_json_is_deterministic_and_round_trips(gpt_plan):
    j = gpt_plan.to_json()
    text = json.dumps(j)
    assert json.loads(text) == j
    assert ModelPlan.from_json(json.loads(text)) == gpt_plan
    assert json.dumps(build_model_plan(GPT, 4, "uniform").to_json()) == text


def stage_inputs(stages, inputs):
    result = []
    with torch.no_grad():
        for stage in stages:
            result.append(inputs)
            inputs = (stage(*inputs),)
    return result


def test_measured_stash_is_positive_and_linear_in_micro_batch_size():
    stashes = {}
    for mb in (1, 2, 4):
        spec = gpt_spec(GPTConfig(**{**TINY.__dict__, "micro_batch": mb}))
        stages = split_model(spec, 3, "uniform")
        inputs = stage_inputs(stages, spec.example_inputs)
        last = len(stages) - 1
        stashes[mb] = [
            measure_stash_bytes(
                st,
                x,
                (lambda o, spec=spec: spec.loss_fn(o, spec.example_target)) if k == last else None,
            )
            for k, (st, x) in enumerate(zip(stages, inputs))
        ]
    for k in range(3):
        s1, s2, s4 = stashes[1][k], stashes[2][k], stashes[4][k]
        assert s1 > 0
        assert s4 - s2 == 2 * (s2 - s1)  # affine in the micro-batch size…
        assert s2 >= 1.95 * s1  # …and nearly proportional (positions are shared by the batch)


class TwiceLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.lin(x) + self.lin(x)


def test_stash_counts_shared_storage_once_and_skips_parameters():
    x = torch.randn(4, 16)
    # Linear saves its input (4·16 floats) and its weight (a parameter: not counted); the same
    # input saved by a second Linear call is counted once.
    model = TwiceLinear()
    assert measure_stash_bytes(model.lin, (x,)) == 4 * 16 * 4
    assert measure_stash_bytes(model, (x,)) == 4 * 16 * 4


def test_tied_embedding_is_reported():
    plan = build_model_plan(f"{ROOT}/examples/gpt.py:tiny_tied", 2, "uniform")
    assert plan.tied == (((0, "wte.weight"), (1, "lm_head.weight")),)
    assert plan.to_json()["tied_parameters"] == [
        [{"stage": 0, "name": "wte.weight"}, {"stage": 1, "name": "lm_head.weight"}]
    ]


def test_chunks_and_replicas_are_recorded():
    plan = build_model_plan(GPT, 8, "uniform", v=2, replicas=2)
    assert (plan.p, plan.v, plan.replicas) == (4, 2, 2)
    with pytest.raises(FrontendError, match="multiple of v=3"):
        build_model_plan(GPT, 8, v=3)
    with pytest.raises(FrontendError, match="replicas=3"):
        build_model_plan(GPT, 8, replicas=3)


def test_build_stages_rebuilds_the_same_stages(gpt_plan):
    j = gpt_plan.to_json()
    reference = split_model(GPT, 4, list(gpt_plan.partition))
    rebuilt = build_stages(GPT, j, [1, 3])
    inputs = stage_inputs(reference, load_factory(GPT).example_inputs)
    for k, stage in zip([1, 3], rebuilt):
        assert [n for n, _ in stage.named_parameters()] == [
            n for n, _ in reference[k].named_parameters()
        ]
        for p, q in zip(stage.parameters(), reference[k].parameters()):
            assert torch.equal(p, q)
        assert torch.equal(stage(*inputs[k]), reference[k](*inputs[k]))
    tampered = json.loads(json.dumps(j))
    tampered["stages"][1]["params"] += 1
    with pytest.raises(FrontendError, match="the model changed since compiling: recompile"):
        build_stages(GPT, tampered, [1])


def test_profiled_plan(capfd):
    plan = build_model_plan(GPT, 4, profile=True, runs=3)
    assert plan.cost_source == "profile"
    assert all(s.seconds.F > 0 and s.seconds.B > 0 and s.seconds.W > 0 for s in plan.stages)
    assert all(s.flops.F > 0 for s in plan.stages)  # FLOPs are recorded either way
    assert "profiling F/B/W" in capfd.readouterr().err


def test_meta_device_models_are_costed_not_profiled():
    spec = gpt_spec(TINY, device="meta")
    plan = build_model_plan(spec, 2)
    assert plan.device == "meta" and all(s.stash_bytes > 0 for s in plan.stages)
    with pytest.raises(FrontendError, match="cannot profile .* meta device"):
        build_model_plan(spec, 2, profile=True)


@pytest.mark.parametrize("family", TWICE_NAMED)
def test_the_stages_hold_every_name_the_model_saves(family, tmp_path):
    """BERT's head bias is also its decoder's, T5's shared embedding its encoder's, decoder's
    and head's; each graph reads one name of them. The stages' state_dicts together are the
    model's, so a checkpoint of the stages loads into the plain model and exports as it."""
    spec = TWICE_NAMED[family]
    stages = split_model(spec, 2)
    model = load_factory(spec).model
    assert set().union(*(stage.state_dict() for stage in stages)) == model.state_dict().keys()
    path = checkpoint.save(tmp_path / "ck", 1, checkpoint.state_dict(stages, None))
    other = load_factory(spec, seed=1).model
    assert checkpoint.load_full(path, other) == 1
    for key, value in model.state_dict().items():
        torch.testing.assert_close(other.state_dict()[key], value, rtol=0, atol=0)
    exported = load_file(checkpoint.export_model(path, tmp_path / "export"))
    assert exported.keys() == model.state_dict().keys()
