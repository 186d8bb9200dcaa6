"""Partitioning: chained stages equal the model exactly; balanced beats uniform; costs; errors."""

from pathlib import Path

import pytest
import torch
from torch import nn

from examples.gpt import GPTConfig
from examples.gpt import make_spec as gpt_spec
from pipec.frontend import FrontendError, ModelSpec, build_model_plan, load_factory, split_model
from pipec.frontend.cost import stage_flops
from pipec.frontend.partition import balanced, uniform

ROOT = Path(__file__).resolve().parents[1]


def chain(stages, inputs):
    for stage in stages:
        out = stage(*inputs)
        inputs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    (out,) = inputs
    return out


def placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("example", ["gpt", "llama"])
@pytest.mark.parametrize(
    "n_stages, partition",
    [(1, "uniform"), (3, "uniform"), (4, "balanced"), (8, "balanced"), (3, [1, 5, 2])],
)
def test_split_equals_unsplit_exactly(example, n_stages, partition):
    spec = load_factory(f"{ROOT}/examples/{example}.py:tiny")
    stages = split_model(spec, n_stages, partition)
    assert len(stages) == n_stages
    torch.testing.assert_close(
        chain(stages, spec.example_inputs), spec.model(*spec.example_inputs), rtol=0, atol=0
    )
    # Stages keep the model's parameter names and, together, hold each parameter once.
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in spec.model.named_parameters())
    # Between stages flows the residual stream only.
    for stage in stages[1:]:
        assert len(placeholders(stage)) == 1


def test_balanced_partition_evens_out_the_lm_head():
    # 16 equal blocks; the vocabulary makes the LM head (with the loss) cost about 4 blocks.
    spec = gpt_spec(GPTConfig(vocab_size=3328, seq_len=32, d_model=64, n_heads=4, n_layers=16))

    def spread(partition):
        plan = build_model_plan(spec, 4, partition)
        costs = [s.flops.F + s.flops.B + s.flops.W for s in plan.stages]
        mean = sum(costs) / len(costs)
        return plan.partition, [abs(c - mean) / mean for c in costs]

    counts, deviation = spread("balanced")
    assert counts == (5, 5, 5, 1)
    assert max(deviation) <= 0.10
    counts, deviation = spread("uniform")
    assert counts == (4, 4, 4, 4)
    assert max(deviation) > 0.10


def test_partition_policies():
    assert uniform(10, 4) == [3, 3, 2, 2]
    assert balanced([1, 1, 1, 1, 4], 2) == [4, 1]
    assert balanced([5, 1, 1, 1, 1, 1, 1], 3) == [1, 3, 3]  # not [1, 1, 5]: same bottleneck
    assert sum(balanced(list(range(1, 40)), 7)) == 39


def test_block_flops_match_the_paper_formulas():
    # Qi et al.: per layer F = sbh(24h+4s), W = 24sbh² from GEMMs + attention; B = sbh(24h+8s)
    # plus 2s²bh for the attention scores torch's counter sees the backward recompute.
    s, b, h = 64, 3, 128
    spec = gpt_spec(
        GPTConfig(vocab_size=64, seq_len=s, d_model=h, n_heads=4, n_layers=3, micro_batch=b)
    )
    stages = split_model(spec, 3, "uniform")
    with torch.no_grad():
        x = stages[0](*spec.example_inputs)
    flops = stage_flops(stages[1], (x,))  # a middle block
    assert (flops.F, flops.B, flops.W) == (
        s * b * h * (24 * h + 4 * s),
        s * b * h * (24 * h + 10 * s),
        24 * s * b * h * h,
    )


def test_bad_partitions_say_what_is_allowed():
    spec = load_factory(f"{ROOT}/examples/gpt.py:tiny")
    with pytest.raises(FrontendError, match="use 1 to 8 stages"):
        split_model(spec, 9, "uniform")
    with pytest.raises(
        FrontendError, match="must have 3 block counts, each at least 1, summing to 8"
    ):
        split_model(spec, 3, [4, 4, 1])
    with pytest.raises(FrontendError, match="not one of uniform, balanced or a comma-separated"):
        split_model(spec, 3, "even")
    assert len(split_model(spec, 3, "2,3,3")) == 3


class Scaled(nn.Module):
    """A block reading a parameter directly (fx get_attr), not through a leaf module."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.rand(d))

    def forward(self, x):
        return x + self.lin(x) * self.gain


class WithRootTensors(nn.Module):
    """Root-level parameter and buffer used inside every block: fx reads them at the root."""

    def __init__(self, d=8, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(Scaled(d) for _ in range(n))
        self.bias = nn.Parameter(torch.rand(d))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * self.scale + self.bias
        return x


def test_parameters_and_buffers_read_directly_move_into_the_stages():
    x = torch.randn(2, 3, 8)
    spec = ModelSpec(WithRootTensors(), (x,), x, nn.functional.mse_loss)
    stages = split_model(spec, 4, "uniform")
    torch.testing.assert_close(chain(stages, (x,)), spec.model(x), rtol=0, atol=0)
    assert all(len(placeholders(st)) == 1 for st in stages)
    plan = build_model_plan(spec, 4, "uniform")
    assert [len(g) for g in plan.tied] == [4]  # `bias` is held by every stage


class SkipConnection(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x):
        x0 = h = self.embed(x)
        for block in self.blocks:
            h = block(h) + x0
        return h


class MaskEverywhere(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x, mask):
        for block in self.blocks:
            x = block(x) * mask
        return x


def test_values_used_by_later_stages_are_forwarded_through_the_stages_between():
    x = torch.randn(2, 4)
    spec = ModelSpec(SkipConnection(), (x,), x, nn.functional.mse_loss)
    stages = split_model(spec, 4, "uniform")
    torch.testing.assert_close(chain(stages, (x,)), spec.model(x), rtol=0, atol=0)
    assert [len(placeholders(st)) for st in stages] == [1, 2, 2, 2]  # h and x0 from stage 1 on
    spec = ModelSpec(MaskEverywhere(), (x, x), x, nn.functional.mse_loss)
    stages = split_model(spec, 2, "uniform")
    torch.testing.assert_close(chain(stages, (x, x)), spec.model(x, x), rtol=0, atol=0)
    assert "mask" in [p.name for p in placeholders(stages[1])]
