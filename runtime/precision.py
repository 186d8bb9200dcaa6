"""bf16 training: where each cast happens (docs/training.md, "Precision").

`to_bf16(modules)` casts the stage modules' floating parameters and buffers to bf16 in place
(parameter objects are kept, so parameters shared by two stages stay shared; the stages were
captured at bf16, pipec/frontend/precision.py) and gives every trained parameter an fp32
`main_grad` (a frozen one, `requires_grad=False`, keeps none, and its fp32 master is never
stepped): each backward's bf16 weight gradient is added into it as soon as
autograd accumulates it (a post-accumulate hook, which then drops the bf16 `.grad`), or by W
for the deferred GEMMs (runtime/bwsplit.py). Gradients are thereby summed over the step's
micro-batches, reduced over data parallelism and clipped in fp32. The fp32 master weights and
the optimizer state live in runtime/optim.py; the first stage casts floating inputs to bf16
(`Rank.batch`), and messages take the dtype of what they carry (`Rank.boundary`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn


def grad_of(p: nn.Parameter) -> Tensor | None:
    """The gradient the optimizer sees: the fp32 `main_grad` under bf16, else `.grad`."""
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def set_grad(p: nn.Parameter, g: Tensor) -> None:
    """Replace the gradient `grad_of` returns (after a reduction)."""
    if hasattr(p, "main_grad"):
        p.main_grad = g
    else:
        p.grad = g


def add_grad(p: nn.Parameter, g: Tensor) -> None:
    """Accumulate one micro-batch's weight gradient `g`: into the fp32 `main_grad` under bf16,
    else into `.grad` as autograd would."""
    if hasattr(p, "main_grad"):
        if p.main_grad is None:
            p.main_grad = g.float()
        else:
            p.main_grad.add_(g)
    elif p.grad is None:
        p.grad = g
    else:
        p.grad += g


def _into_main_grad(p: Tensor) -> None:
    if p.grad is None:  # a product whose weight gradient W computes later (runtime/bwsplit.py)
        return
    add_grad(p, p.grad)
    p.grad = None


def to_bf16(modules: Iterable[nn.Module]) -> dict[str, Tensor]:
    """Cast `modules` to bf16 for training (see the module doc); returns the fp32 floating
    buffers by name, which checkpoints store instead of their bf16 copies."""
    buffers: dict[str, Tensor] = {}
    done: set[int] = set()
    for module in modules:
        for name, b in module.named_buffers():
            if b.is_floating_point():
                buffers.setdefault(name, b.detach().clone())
        for p in module.parameters():
            if id(p) in done or not p.is_floating_point() or not p.requires_grad:
                continue  # a frozen parameter has no gradient to keep: it stays unhooked
            done.add(id(p))
            p.main_grad = None
            p.register_post_accumulate_grad_hook(_into_main_grad)
        module.to(torch.bfloat16)
    return buffers
