"""FLOPs of a stage's F, B and W, counted by torch (`torch.utils.flop_counter.FlopCounterMode`).

`stage_flops(stage, inputs, loss)` runs one micro-batch through the stage the way the runtime
does (`runtime.bwsplit.split_backward`: F, then B with the weight-gradient GEMMs queued, then
W) and counts each phase's FLOPs: every matmul, `addmm`, convolution and attention kernel
torch's counter knows, wherever it sits (inside a leaf module too). Elementwise ops count zero,
as in torch's counter and the papers' formulas. It runs on fake tensors (`FakeTensorMode`): no
memory is allocated and nothing is computed, so a paper-sized model on the meta device costs
in seconds (a model on the meta device runs as it is). A stage whose ops cannot run on fake
tensors (data-dependent shapes) is counted on its real inputs instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import (
    FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from pipec.frontend.blocks import Stacks
from pipec.runtime.bwsplit import B, W, split_backward

aten = torch.ops.aten


def _cpu_sdpa(q, k, v, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
    return sdpa_flop_count(q, k, v)


def _cpu_sdpa_backward(grad_out, q, k, v, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
    return sdpa_backward_flop_count(grad_out, q, k, v)


# SDPA's CPU kernels, which torch's counter does not list (its formulas are the same; the
# counter hands these shapes).
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


@dataclass(frozen=True)
class Flops:
    """FLOPs of one stage and micro-batch: forward, input-gradient backward, weight-gradient."""

    F: int = 0
    B: int = 0
    W: int = 0

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.F + other.F, self.B + other.B, self.W + other.W)

    @property
    def total(self) -> int:
        return self.F + self.B + self.W


def stage_flops(
    stage: nn.Module,
    inputs: tuple[Tensor, ...],
    loss: Callable[[Any], Tensor] | None = None,
) -> Flops:
    """F, B, W FLOPs of one micro-batch `inputs` through `stage` (`loss` on the last stage).

    Prepares the stage with `split_backward` (as the runtime does when it splits B and W).
    Gradients go to detached copies of the parameters, never to the stage's own.
    """
    split_backward(stage)
    tensors = [*inputs, *stage.parameters()]
    if all(t.device.type == "meta" for t in tensors):
        return _count(stage, inputs, loss, Tensor.detach)  # computes nothing already
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            return _count(stage, inputs, loss, mode.from_tensor)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        # Data-dependent shapes (nonzero, item) have no fake value: count on real tensors.
        return _count(stage, inputs, loss, Tensor.detach)


def _count(
    stage: nn.Module,
    inputs: tuple[Tensor, ...],
    loss: Callable[[Any], Tensor] | None,
    convert: Callable[[Tensor], Tensor],
) -> Flops:
    # each tensor once: functional_call gives its other names (tied) the same value
    params = {
        name: convert(p).requires_grad_(p.requires_grad) for name, p in stage.named_parameters()
    }
    leaves = tuple(convert(x).requires_grad_(x.is_floating_point()) for x in inputs)
    counts = []
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        out = functional_call(stage, params, leaves, strict=False)
        if loss is not None:
            out = loss(out)
        counts.append(counter.get_total_flops())
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        grads = None if loss is not None else [torch.ones_like(t) for t in outputs]
        if outputs:
            B(stage, 0, outputs, grads, leaves)
        counts.append(counter.get_total_flops())
        if outputs:
            W(stage, 0)
        counts.append(counter.get_total_flops())
    return Flops(counts[0], counts[1] - counts[0], counts[2] - counts[1])


def count_flops(
    stages: list[fx.GraphModule],
    inputs: list[tuple[Tensor, ...]],
    starts: list[int],
    stacks: Stacks,
    loss: Callable[[Any], Tensor],
) -> list[Flops]:
    """`stage_flops` of each stage (`loss` on the last), counted once per distinct stage:
    stages whose graphs differ only in which blocks they hold (a decoder's middle stages) have
    the same FLOPs, so an 80-layer model is counted in a few runs. `starts[k]`: the first
    block of stage k, counted across the model's `stacks`."""
    counted: dict[str, Flops] = {}
    result = []
    for k, (stage, x) in enumerate(zip(stages, inputs)):
        last = k == len(stages) - 1
        key = _signature(stage, x, stacks, starts[k]) + f"|last={last}"
        if key not in counted:
            counted[key] = stage_flops(stage, x, loss if last else None)
        result.append(counted[key])
    return result


def _signature(
    stage: fx.GraphModule, inputs: tuple[Tensor, ...], stacks: Stacks, first: int
) -> str:
    """The stage's ops (nodes by position, block indices relative to its first block) and its
    parameters' and inputs' shapes: equal for stages that compute the same ops on the same
    shapes."""
    pattern = stacks.pattern()

    def relative(target: object) -> str:
        if not isinstance(target, str):
            return repr(target)
        return pattern.sub(lambda m: f"{m[1]}@{stacks.index(m) - first}{m[3]}", target)

    position = {n: i for i, n in enumerate(stage.graph.nodes)}
    lines = [f"{tuple(x.shape)} {x.dtype}" for x in inputs]
    lines += [f"{relative(n)} {tuple(p.shape)} {p.dtype}" for n, p in stage.named_parameters()]
    for node in stage.graph.nodes:
        args = fx.map_arg((node.args, node.kwargs), lambda a: f"%{position[a]}")
        target = "" if node.op == "placeholder" else relative(node.target)  # its name
        lines.append(f"{node.op} {target} {args}")
    return "\n".join(lines)
