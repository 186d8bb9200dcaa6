"""What a chain of stages passes along: every cut's values, checked, and the model output.

`run_boundaries(stages, spec)` runs the example micro-batch through the stages without
autograd and returns each stage's inputs and the model's output; it refuses in one line what the
runtime cannot carry (a value that is not a tensor, more tensors than one message holds) and a
`loss_fn` that cannot score the output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from pipec.frontend.spec import FrontendError, ModelSpec
from pipec.ir import MAX_TENSORS


def run_boundaries(
    stages: list[fx.GraphModule], ms: ModelSpec
) -> tuple[list[tuple[Tensor, ...]], Any]:
    """Every stage's input for the example micro-batch, and the model output (no autograd).

    Raises FrontendError when a value crossing a cut is not a tensor (the runtime sends
    tensors only), when one cut carries more tensors than a message holds, or when `loss_fn`
    cannot score the output.
    """
    values, x = [ms.example_inputs], ms.example_inputs
    with torch.no_grad():
        for k, stage in enumerate(stages[:-1]):
            y = stage(*x)
            x = (y,) if isinstance(y, Tensor) else tuple(y)
            names = input_names(stages[k + 1])
            for name, value in zip(names, x):
                if not isinstance(value, Tensor):
                    raise FrontendError(
                        f"value '{name}' ({type(value).__name__}) crosses from stage {k} to "
                        f"stage {k + 1} of {type(ms.model).__name__}; stages exchange tensors "
                        "only: compute it from tensors inside each block, or capture with "
                        'torch.export (ModelSpec.capture="export"), which folds sizes'
                    )
            if len(x) > MAX_TENSORS:
                raise FrontendError(
                    f"stage {k} of {type(ms.model).__name__} passes {len(x)} tensors to stage "
                    f"{k + 1} ({', '.join(names)}); the runtime sends at most {MAX_TENSORS}: "
                    "choose other split points"
                )
            values.append(x)
        output = stages[-1](*x)
    check_loss(ms, output)
    return values, output


def check_loss(ms: ModelSpec, output: Any) -> None:
    """`loss_fn(output, target)` must give a scalar floating tensor."""
    what = f"{type(ms.model).__name__}.forward returned {_describe(output)}"
    try:
        with torch.no_grad():
            loss = ms.loss_fn(output, ms.example_target)
    except Exception as e:
        raise FrontendError(
            f"loss_fn raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]} ({what}); "
            "loss_fn gets the output as forward returns it, e.g. "
            "lambda out, y: next_token_loss(out.logits, y)"
        ) from e
    if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise FrontendError(
            f"loss_fn returned {_describe(loss)} ({what}); it must return a scalar loss tensor"
        )


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}"


def named_leaves(output: Any) -> tuple[tuple[str, ...], tuple[Tensor, ...]]:
    """Names ("output", "output.logits", "output[1]") and tensors of the model output."""
    leaves = [
        (f"output{pytree.keystr(path)}", t)
        for path, t in pytree.tree_flatten_with_path(output)[0]
        if isinstance(t, Tensor)
    ]
    return tuple(n for n, _ in leaves), tuple(t for _, t in leaves)


def input_names(stage: fx.GraphModule) -> tuple[str, ...]:
    """A stage's input names (its placeholders), in order."""
    return tuple(n.name for n in stage.graph.nodes if n.op == "placeholder")
