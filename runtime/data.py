"""Training data for the runtime: deterministic synthetic micro-batches shaped like the example.

Every rank that needs micro-batch i (the first stage its inputs, the last stage its target)
and the single-process reference draw the same tensors from a generator seeded by (seed, i):
integer tensors (token ids) uniformly from the range the factory's example uses, floating ones
from a standard normal. The same micro-batches come back every step, a fixed small data set the
model can fit, so a falling loss shows that training works.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipec.frontend import ModelSpec


def micro_batch(spec: ModelSpec, index: int, seed: int = 0) -> tuple[tuple[Tensor, ...], Tensor]:
    """Inputs and target of global micro-batch `index` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)

    def like(example: Tensor) -> Tensor:
        if example.is_floating_point():
            return torch.randn(example.shape, generator=gen, dtype=example.dtype)
        low, high = int(example.min()), int(example.max()) + 1
        return torch.randint(low, high, example.shape, generator=gen, dtype=example.dtype)

    inputs = tuple(like(x.cpu()) for x in spec.example_inputs)
    return inputs, like(spec.example_target.cpu())
