"""Split a stage's backward into B (input gradients) and W (weight gradients).

`split_backward(stage)` replaces every `nn.Linear` of the stage with a `SplitLinear` that shares
its parameters and whose autograd backward returns only dX, queueing (x, dY) under the current
micro-batch. Then:

- `B(stage, mb, outputs, grad_outputs, inputs)` runs autograd backward through the stage:
  input gradients, plus the weight gradients of norms and embeddings (cheap, elementwise-sized;
  computed right away rather than deferred), while every Linear's dW/db waits in the queue.
- `W(stage, mb)` runs the queued dW = dYᵀx and db = ΣdY GEMMs of that micro-batch and
  accumulates them into `.grad`.

Between B and W a micro-batch holds the Linear inputs and output gradients (Qi et al.'s M_W).
Outside `B` (a plain `loss.backward()`), a SplitLinear computes its weight gradient immediately,
so a split stage still trains correctly under an unsplit schedule.

Exactness: dW and db are computed with the same GEMM and reduction torch's linear backward
uses, so each micro-batch's gradients are bit-identical to plain autograd; accumulating two
micro-batches is also bit-identical in any order (floating-point addition is commutative);
three or more may differ in the last bit when W runs in a different order than B (addition is
not associative).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.stash import tensors_nbytes

_QUEUE_ATTR = "weight_grad_queue"


class WeightGradQueue:
    """Deferred weight-gradient work of one stage, keyed by micro-batch."""

    def __init__(self) -> None:
        self._pending: dict[int, list[tuple[SplitLinear, Tensor, Tensor]]] = {}
        self._collecting: int | None = None
        self.native = False  # forwards run plain nn.Linear (see `unsplit`)

    @contextmanager
    def collect(self, mb: int) -> Iterator[None]:
        """Within this context, SplitLinear backwards queue their work under `mb`."""
        if mb in self._pending:
            raise RuntimeError(f"B for micro-batch {mb} ran twice without W in between")
        self._pending[mb] = []
        self._collecting = mb
        try:
            yield
        finally:
            self._collecting = None

    def defer(self, linear: SplitLinear, x: Tensor, dy: Tensor) -> None:
        """Queue (x, dY) of `linear` under the collecting micro-batch, or apply it now."""
        if self._collecting is None:
            _accumulate_weight_grad(linear, x, dy)
        else:
            self._pending[self._collecting].append((linear, x, dy))

    def run(self, mb: int) -> None:
        """Compute and accumulate the queued weight gradients of `mb`, freeing (x, dY)."""
        if mb not in self._pending:
            raise RuntimeError(f"W for micro-batch {mb} before its B (pending: {self.pending})")
        for linear, x, dy in self._pending.pop(mb):
            _accumulate_weight_grad(linear, x, dy)

    def held_bytes(self, mb: int) -> int:
        """Bytes the queued work of `mb` keeps alive until W: its inputs and output gradients."""
        return tensors_nbytes([t for _, x, dy in self._pending.get(mb, ()) for t in (x, dy)])

    @property
    def pending(self) -> list[int]:
        """Micro-batches whose B ran and W did not, in B order."""
        return list(self._pending)


class _SplitLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, linear, queue):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, weight)
        ctx.linear, ctx.queue = linear, queue
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def]
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # Detached: x comes back with its history, which reaches the stage inputs (and
            # the gradients B gives them); W needs only x's values.
            ctx.queue.defer(ctx.linear, x.detach(), dy)
        return dx, None, None, None, None


class SplitLinear(nn.Module):
    """An `nn.Linear` (same parameters, same state_dict keys) whose dW/db are deferred to W."""

    def __init__(self, linear: nn.Linear, queue: WeightGradQueue) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._queue = queue

    def forward(self, x: Tensor) -> Tensor:
        if self._queue.native:
            return F.linear(x, self.weight, self.bias)
        return _SplitLinearFunction.apply(x, self.weight, self.bias, self, self._queue)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


@torch.no_grad()
def _accumulate_weight_grad(linear: SplitLinear, x: Tensor, dy: Tensor) -> None:
    # The reductions torch's own linear backward performs (mm backward on the flattened
    # input, bias gradient as a sum over the flattened rows), so results are bit-identical.
    # Without grad mode: a recorded GEMM would make each .grad hold x and dY (and W's own
    # graph) until the gradients are zeroed.
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    grads = [(linear.weight, dy2.t().mm(x2))]
    if linear.bias is not None:
        grads.append((linear.bias, dy2.sum(0)))
    for p, g in grads:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g


def split_backward(stage: nn.Module) -> WeightGradQueue:
    """Replace every `nn.Linear` in `stage` with a `SplitLinear`; return the stage's queue.

    Parameters are shared, not copied, so optimizers and state_dicts see the same tensors.
    Idempotent: a stage already split returns its existing queue.
    """
    existing = getattr(stage, _QUEUE_ATTR, None)
    if isinstance(existing, WeightGradQueue):
        return existing
    queue = WeightGradQueue()
    for name, module in list(stage.named_modules()):
        if type(module) is nn.Linear:
            owner_name, _, attr = name.rpartition(".")
            owner = stage.get_submodule(owner_name) if owner_name else stage
            setattr(owner, attr, SplitLinear(module, queue))
    object.__setattr__(stage, _QUEUE_ATTR, queue)  # a plain attribute, not a submodule
    return queue


@contextmanager
def unsplit(stage: nn.Module, active: bool) -> Iterator[None]:
    """While `active`, the stage's Linears run natively: for a forward whose backward will be a
    fused BW (DualPipeV mixes BW with B/W), the split's Python autograd Function only costs
    time (~10% of a tiny GPT stage's F+BW), and torch's own backward computes dW at once."""
    queue: WeightGradQueue | None = getattr(stage, _QUEUE_ATTR, None)
    if not active or queue is None:
        yield
        return
    queue.native = True
    try:
        yield
    finally:
        queue.native = False


def _queue(stage: nn.Module) -> WeightGradQueue:
    queue: WeightGradQueue | None = getattr(stage, _QUEUE_ATTR, None)
    if queue is None:
        raise RuntimeError(f"{type(stage).__name__} was not prepared with split_backward(stage)")
    return queue


def B(
    stage: nn.Module,
    mb: int,
    outputs: Tensor | Sequence[Tensor],
    grad_outputs: Tensor | Sequence[Tensor] | None = None,
    inputs: Sequence[Tensor] = (),
) -> tuple[Tensor | None, ...]:
    """Input-gradient backward of micro-batch `mb` through `stage`.

    `outputs` are the stage's outputs with `grad_outputs` the gradients received from the next
    stage, or the scalar loss with `grad_outputs=None` on the last stage. Returns the gradients
    of `inputs` (the stage's received activations, created with `requires_grad=True`; None for
    integer inputs such as token ids). Linear weight gradients stay queued until `W(stage, mb)`;
    norm and embedding weight gradients are accumulated now.
    """
    with _queue(stage).collect(mb):
        torch.autograd.backward(outputs, grad_outputs)
    return tuple(x.grad if x.requires_grad else None for x in inputs)


def W(stage: nn.Module, mb: int) -> None:
    """Weight-gradient backward of micro-batch `mb`: run its queued GEMMs into `.grad`."""
    _queue(stage).run(mb)


def held_bytes(stage: nn.Module, mb: int) -> int:
    """Bytes W(stage, mb) still needs after B: what Qi et al. call M_W, measured."""
    return _queue(stage).held_bytes(mb)
