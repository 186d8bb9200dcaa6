"""FLOPs come from torch's counter: Conv1D (addmm), Conv2d patches and torch.nn layers count; the
balanced partition evens out the true per-stage FLOPs and is never worse than uniform."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from examples.hf_llama import TINY as LLAMA_TINY
from examples.hf_llama import make_spec as llama_spec
from pipec.frontend import build_model_plan, split_model
from pipec.frontend import cost as cost_module
from pipec.frontend import plan as plan_module
from pipec.frontend.cost import CPU_ATTENTION_FLOPS, stage_flops
from pipec.frontend.partition import resolve
from pipec.frontend.stages import split
from tests.frontend_models import stock

ROOT = Path(__file__).resolve().parents[1]
count = stage_flops
MODELS = {
    "hf-gpt2": lambda: stock.gpt2(8),
    "hf-llama": lambda: llama_spec(
        LLAMA_TINY.__class__(**{**LLAMA_TINY.to_dict(), "num_hidden_layers": 8})
    ),
    "encoder": lambda: stock.encoder(8),
    "vit": stock.vit,
}


def true_flops(stages, spec) -> list[int]:
    """F + B (all of the backward) of each stage on the example, counted by FlopCounterMode with
    plain autograd: no B/W split in the count (SDPA's CPU kernels added to torch's table)."""
    x, counts = spec.example_inputs, []
    for k, stage in enumerate(stages):
        leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            out = stage(*leaves)
            if k == len(stages) - 1:
                spec.loss_fn(out, spec.example_target).backward()
            else:
                outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
                grads = [torch.ones_like(o) for o in outs if o.requires_grad]
                torch.autograd.backward([o for o in outs if o.requires_grad], grads)
                x = tuple(o.detach() for o in outs)
        counts.append(counter.get_total_flops())
    return counts


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    """The model captured once, with its blocks' counted FLOPs (what "balanced" divides)."""
    torch.manual_seed(0)
    spec = MODELS[request.param]()
    traced = plan_module._trace(spec, 0)
    return request.param, traced, [f.total for f in plan_module._block_flops(traced)]


@pytest.mark.parametrize("n_stages", [2, 4])
def test_balanced_evens_out_true_flops_and_never_loses_to_uniform(model, n_stages):
    name, traced, block_costs = model
    counts = {mode: resolve(mode, block_costs, n_stages)[1] for mode in ("balanced", "uniform")}
    true = {
        mode: true_flops(split(traced.gm, traced.block_of, c), traced.spec)
        for mode, c in counts.items()
    }
    balanced, uniform = true["balanced"], true["uniform"]
    assert max(balanced) <= max(uniform), (name, balanced, uniform)
    # 8 blocks, an embedding and a head lighter than a block: granularity allows 1.3.
    assert max(balanced) / min(balanced) <= 1.3, (name, balanced)


def test_conv1d_and_conv2d_count_as_torch_counts_them():
    spec = stock.vit()
    stages = split_model(spec, 2, "uniform")
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        stages[0](*spec.example_inputs)
    patches = counter.get_flop_counts()["Global"][torch.ops.aten.convolution]
    assert patches == 2 * 2 * 64 * 64 * (3 * 4 * 4)  # 2·batch·patches·d·(channels·4·4)
    assert stage_flops(stages[0], spec.example_inputs).F == counter.get_total_flops()
    gpt2 = stock.gpt2()
    first = split_model(gpt2, 2, "uniform")[0]
    flops = stage_flops(first, gpt2.example_inputs)
    tokens, d = 2 * 16, 64
    assert flops.W == 2 * (2 * 12 * tokens * d * d)  # Conv1D (addmm) weight gradients, 2 layers


def test_a_paper_sized_model_costs_in_a_few_counts(monkeypatch):
    # 80 layers on the meta device: the balanced split counts each distinct block once (first,
    # middle, last), then each distinct stage: a few seconds instead of 88 counts.
    counted = []
    monkeypatch.setattr(cost_module, "stage_flops", lambda *a: counted.append(a) or count(*a))
    plan = build_model_plan(f"{ROOT}/examples/gpt.py:gpt3_96b", 8, progress=False)
    assert len(counted) <= 6
    h, s = 9984, 2048
    layer = 24 * s * h * h + 4 * s * s * h  # Qi et al.'s F of one layer (micro-batch 1)
    assert plan.stages[1].flops.F == 10 * layer
    assert plan.partition == (10,) * 8
