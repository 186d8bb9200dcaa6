"""A model captured at the precision it will compute in.

torch.export records the dtypes the model computed in while it was captured: a Hugging Face
RMSNorm's `hidden.to(input_dtype)` becomes `to(float32)` when captured in fp32, a rotary
table's `.to(x.dtype)` too, a causal mask is built with `dtype=float32`. Cast to bf16 afterwards,
such a graph mixes dtypes (`expected m1 and m2 to have the same dtype`). So a bf16 run captures a
copy of the model cast as `model.to(torch.bfloat16)` casts it (floating parameters and buffers),
with its floating example inputs in bf16: every dtype the graph records is then the one the
model computes in at bf16, and what the model itself keeps in fp32 (`inv_freq.float()`, a
variance in fp32) stays fp32. The captured stages then take the model's own values back
(`take_values`), so the run starts from the fp32 weights the optimizer's masters are made of.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, fx, nn

from pipec.frontend.boundaries import named_leaves
from pipec.frontend.spec import FrontendError, ModelSpec

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""`--precision` choices and the compute dtype each sets (None: the model's own)."""

#: Where a stage module built at a precision keeps the dtypes of its inputs and outputs at it
#: (`GraphModule.meta`): what its messages carry, which the plan (measured at the model's dtype)
#: cannot say.
BOUNDARY_DTYPES = "pipec_boundary_dtypes"


def inputs_at(ms: ModelSpec, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The example inputs as a first stage receives them at `dtype`: floating ones cast."""
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in ms.example_inputs)


def at_dtype(ms: ModelSpec, dtype: torch.dtype) -> ModelSpec:
    """A copy of `ms` as it runs at `dtype`: its model cast (floating parameters and buffers),
    its floating example inputs cast; the target and the loss as they are."""
    model = copy.deepcopy(ms.model).to(dtype)
    return replace(ms, model=model, example_inputs=inputs_at(ms, dtype))


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    return dict(named)


def take_values(captured: nn.Module, model: nn.Module) -> None:
    """Give every parameter and buffer of `captured` (a capture of a cast copy of `model`) the
    value and dtype of `model`'s tensor of the same name, in place (tied parameters stay one)."""
    own = _tensors(model)
    for name, t in _tensors(captured).items():
        if name in own:
            t.data = own[name].detach().to(t.device)


class _Naming(fx.Interpreter):
    """Runs a stage node by node, so that an op that raises can be named, with its module."""

    def __init__(self, stage: fx.GraphModule) -> None:
        super().__init__(stage)
        self.extra_traceback = False  # fx's note on the failing node: the one line says it

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception as e:  # noqa: BLE001 - any op's failure, named for the user
            stack = n.meta.get("nn_module_stack") or {}
            path, cls = next(reversed(stack.values()), ("", None))
            where = f" in {path} ({getattr(cls, '__name__', cls)})" if path else ""
            op = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target)
            raise FrontendError(f"{op}{where}: {(str(e).splitlines() or [''])[0]}") from None


def run_at(
    stages: list[fx.GraphModule], ms: ModelSpec, dtype: torch.dtype, backward: bool = False
) -> list[dict[str, tuple[torch.dtype, ...]]]:
    """Run the example micro-batch through `stages` (captured at `dtype`, still holding their
    cast values) at `dtype`, and with `backward` its loss's backward too; return per stage the
    dtypes of its inputs and outputs at `dtype`. Not all are `dtype`: a model may keep a value in
    fp32 on purpose (Mamba's residual stream), and its messages then carry fp32.

    Raises FrontendError naming the op (and its module) that cannot compute at `dtype`, or the
    backward's error."""
    x, dtypes = inputs_at(ms, dtype), []
    with torch.set_grad_enabled(backward):
        for k, stage in enumerate(stages):
            try:
                y = _Naming(stage).run(*x)
            except FrontendError as e:
                raise FrontendError(f"stage {k}: {e}") from None
            out = named_leaves(y)[1] if k == len(stages) - 1 else _as_tuple(y)
            dtypes.append(
                {"inputs": tuple(t.dtype for t in x), "outputs": tuple(t.dtype for t in out)}
            )
            x = out
        if backward:
            try:
                ms.loss_fn(y, ms.example_target).backward()
            except Exception as e:  # noqa: BLE001 - the backward's own message is all there is
                raise FrontendError(f"the backward: {(str(e).splitlines() or [''])[0]}") from None
    return dtypes


def _as_tuple(y: Any) -> tuple[Tensor, ...]:
    return (y,) if isinstance(y, Tensor) else tuple(y)
