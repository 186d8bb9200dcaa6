"""FLOP estimates per fx node, split into forward (F), input-gradient (B) and weight-gradient (W).

The model, per op kind (shapes from one `ShapeProp` pass over the example micro-batch):

- matmul / linear: F = 2·M·N·K. With a weight (an `nn.Linear`, or a matmul with a parameter
  operand): B = W = F (dX and dW are one GEMM each). Between two activations: B = 2F, W = 0.
- attention (`runtime.kernels.attention`, SDPA): F = 4·b·h·s_q·s_kv·d (QKᵀ and PV, causal
  masking ignored as in the papers' formulas), B = 2F, W = 0.
- views, reshapes, indexing, concatenation, dtype casts: 0 (no arithmetic).
- everything else (norms, activations, adds, embedding lookups): F = numel(output), B = 2F,
  W = 0. Norm and embedding weight gradients are computed in B by the runtime, so they count
  there too. The loss counts as one such op over the model output, on the last stage.

On a GPT layer this reproduces Qi et al.'s F = sbh(24h+4s), B = sbh(24h+8s), W = 24sbh² for the
GEMMs and attention, plus O(sbh) for the elementwise ops.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata


@dataclass(frozen=True)
class Flops:
    """Estimated FLOPs of one op or stage: forward, input-gradient backward, weight-gradient."""

    F: int = 0
    B: int = 0
    W: int = 0

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.F + other.F, self.B + other.B, self.W + other.W)

    @property
    def total(self) -> int:
        return self.F + self.B + self.W


_ZERO_FUNCTIONS = {
    operator.getitem,
    getattr,
    torch.arange,
    torch.cat,
    torch.stack,
    torch.flatten,
    torch.reshape,
    torch.transpose,
    torch.permute,
    torch.unsqueeze,
    torch.squeeze,
    torch.split,
    torch.chunk,
    torch.t,
    torch.narrow,
    torch.select,
}
_ZERO_METHODS = {
    "size",
    "dim",
    "view",
    "view_as",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "flatten",
    "unflatten",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "split",
    "chunk",
    "t",
    "to",
    "type",
    "type_as",
    "float",
    "half",
    "bfloat16",
    "narrow",
    "select",
    "repeat_interleave",
}
_MATMUL_FUNCTIONS = {operator.matmul, torch.matmul, torch.bmm, torch.mm, F.linear}
_MATMUL_METHODS = {"matmul", "bmm", "mm"}


def _attention_functions() -> set[object]:
    funcs: set[object] = {F.scaled_dot_product_attention}
    try:
        from runtime.kernels import attention
    except ImportError:
        return funcs
    return funcs | {attention}


def node_flops(
    gm: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...]
) -> dict[fx.Node, Flops]:
    """FLOPs of every node of `gm` for one micro-batch `example_inputs` (runs `gm` once)."""
    ShapeProp(gm).propagate(*example_inputs)
    attention_fns = _attention_functions()
    return {node: _flops(gm, node, attention_fns) for node in gm.graph.nodes}


def loss_flops(gm: fx.GraphModule) -> Flops:
    """The loss, counted as one elementwise op over the model output (after `node_flops`)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return _elementwise(_numel(output.args[0]))


def _flops(gm: fx.GraphModule, node: fx.Node, attention_fns: set[object]) -> Flops:
    if node.op in ("placeholder", "get_attr", "output"):
        return Flops()
    out = _numel(node)
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Linear):
            f = 2 * out * module.in_features
            return Flops(f, f, f)
        return _elementwise(out)
    is_method = node.op == "call_method"
    if (node.target in _ZERO_METHODS) if is_method else (node.target in _ZERO_FUNCTIONS):
        return Flops()
    if node.target in attention_fns:
        b, h, s_q, d = _shape(node.args[0])
        s_kv = _shape(node.args[1])[2]
        f = 4 * b * h * s_q * s_kv * d
        return Flops(f, 2 * f, 0)
    if (node.target in _MATMUL_METHODS) if is_method else (node.target in _MATMUL_FUNCTIONS):
        f = 2 * out * _shape(node.args[0])[-1]
        if any(_is_parameter(gm, a) for a in node.args[:2]):
            return Flops(f, f, f)
        return Flops(f, 2 * f, 0)
    return _elementwise(out)


def _elementwise(numel: int) -> Flops:
    return Flops(numel, 2 * numel, 0)


def _shape(arg: object) -> tuple[int, ...]:
    meta = arg.meta.get("tensor_meta") if isinstance(arg, fx.Node) else None
    return tuple(meta.shape) if isinstance(meta, TensorMetadata) else ()


def _numel(node: fx.Node) -> int:
    meta = node.meta.get("tensor_meta")
    return math.prod(meta.shape) if isinstance(meta, TensorMetadata) else 0


def _is_parameter(gm: fx.GraphModule, arg: object) -> bool:
    """Whether `arg` is a parameter, possibly seen through views (`x @ self.wte.weight.t()`)."""
    while isinstance(arg, fx.Node):
        if arg.op == "get_attr":
            return isinstance(_get_attr(gm, str(arg.target)), nn.Parameter)
        zero_cost = arg.target in (_ZERO_METHODS if arg.op == "call_method" else _ZERO_FUNCTIONS)
        if arg.op not in ("call_method", "call_function") or not zero_cost or not arg.args:
            return False
        arg = arg.args[0]
    return False


def _get_attr(gm: fx.GraphModule, target: str) -> object:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)
