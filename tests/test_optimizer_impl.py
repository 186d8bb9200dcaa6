"""The Trainer's torch optimizer step, in one process (the tiny GPT on one rank, no process
group): `--optimizer-impl foreach` (the default) steps with torch's multi-tensor kernels and
gives the numbers of torch's default step (a loop over the parameters on CPU) bit for bit;
`fused` gives torch's fused step's numbers, which round differently. launch.py's option
reaches the Trainer and the line a run prints before its first step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipec.frontend import load_factory
from pipec.runtime.lr import Schedule
from pipec.runtime.optim import Trainer, TrainOptions
from pipec.runtime.options import parse_launch

ROOT = Path(__file__).resolve().parents[1]
SPEC = f"{ROOT}/tests/train_factories.py:copying"
STEPS, LR, DECAY = 12, 1e-2, 0.1


def one_rank(model: torch.nn.Module) -> SimpleNamespace:
    """What the Trainer reads of a Rank holding the whole model as one stage."""
    layout = SimpleNamespace(
        n_chunks=1, stage_chunk={0: 0}, pipelines=[SimpleNamespace(stages=(0,))]
    )
    return SimpleNamespace(
        modules={0: model},
        layout=layout,
        build=SimpleNamespace(plan={"model": {"tied_parameters": []}}),
        compute_dtype=None,
        dp=1,
        dp_index=0,
        world=1,
        rank=0,
        device=torch.device("cpu"),
        step=0,
        loss_sums=lambda: torch.zeros(2, dtype=torch.float64),
    )


def trained(optimizer: str, implementation: str, trainer: bool = True) -> list[torch.Tensor]:
    """The parameters after STEPS steps on fixed random gradients: through the Trainer with
    `implementation`, or straight through torch.optim with the same two groups (foreach:
    torch's default step, as `torch.optim.AdamW(groups)` takes it)."""
    model = load_factory(SPEC, 0).model
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(STEPS)]
    if not trainer:
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
        how = {"fused": True} if implementation == "fused" else {}
        step = cls(groups, lr=LR, **how).step
    else:
        rt = one_rank(model)
        options = TrainOptions(Schedule(LR, STEPS), optimizer, implementation, weight_decay=DECAY)
        trainer = Trainer(rt, options)
        assert trainer.inner.defaults[implementation] is True
        step = trainer.step
    for k, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        if trainer:
            rt.step = k + 1
        step()
        for p in params:
            p.grad = None
    return [p.detach() for p in params]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_foreach_gives_torchs_default_step_bit_for_bit(optimizer):
    want = trained(optimizer, "foreach", trainer=False)
    assert all(map(torch.equal, trained(optimizer, "foreach"), want))


def test_fused_gives_torchs_fused_step_which_rounds_differently():
    fused = trained("adamw", "fused")
    assert all(map(torch.equal, fused, trained("adamw", "fused", trainer=False)))
    default = trained("adamw", "foreach", trainer=False)
    torch.testing.assert_close(fused, default, rtol=1e-5, atol=1e-6)
    assert not all(map(torch.equal, fused, default))


def test_launch_option_reaches_the_trainer_and_the_training_line():
    config = parse_launch(["--steps", "5", "--optimizer-impl", "fused"])
    assert config.training.trainer_options().implementation == "fused"
    assert config.training_line().startswith("training to step 5: AdamW (fused) lr")
    plain = parse_launch(["--steps", "5"])
    assert plain.training.trainer_options().implementation == "foreach"
    assert plain.training_line().startswith("training to step 5: AdamW lr")
