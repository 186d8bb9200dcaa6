"""Factories for the micro-batch size tests: one per way a factory can treat the keyword.

Four linear blocks on 8 features; each factory gives micro-batches of 2 samples by default.
"""

import torch
from torch import nn

from pipec.frontend import ModelSpec

FEATURES, OWN_SIZE = 8, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(FEATURES, FEATURES) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _spec(samples: int) -> ModelSpec:
    x, target = torch.randn(samples, FEATURES), torch.randn(samples, FEATURES)
    return ModelSpec(Net(), (x,), target, nn.functional.mse_loss)


def fixed() -> ModelSpec:
    """No keyword: micro-batches of 2 only."""
    return _spec(OWN_SIZE)


def sized(micro_batch_size: int = OWN_SIZE) -> ModelSpec:
    """Takes the keyword and sizes its example by it."""
    return _spec(micro_batch_size)


def by_kwargs(**options: int) -> ModelSpec:
    """Takes any keyword, this one among them."""
    return _spec(options.get("micro_batch_size", OWN_SIZE))


def ignores(micro_batch_size: int = OWN_SIZE) -> ModelSpec:
    """Takes the keyword but gives its own size whatever is asked."""
    return _spec(OWN_SIZE)
