"""A captured stage as it is executed: each op called through its fastest equal entry point.

A torch.export graph calls every ATen op as an `OpOverload` (`torch.ops.aten.linear.default`),
which goes through torch's boxed, schema-checked path: about 2 µs more per call than torch's
generated binding (`torch._C._nn.linear`), which dispatches to the same kernel and records the
same autograd node. The tiny GPT's stage runs ~80 such calls per forward. `DIRECT` maps an
overload to that binding where the binding's overload resolution lands on the same overload
for every argument the overload takes (tests/test_direct.py checks each pair); other ops
keep their overload. Runtime kernels add their own entries: runtime/kernels/attention.py maps
the `pipec::attention` op (and the `attention` function torch.fx records) to a plain autograd
function, which skips two custom-op dispatches and the forward recomputed in the backward.

`direct_calls(stage)` returns a copy of the stage calling `DIRECT`'s entries. Everything that
runs a stage or measures what it holds runs that copy: the runtime (`build_stages`), the
stash bytes of the plan and `--profile`. FLOPs are counted on the captured graph (a Triton
kernel called directly is invisible to FlopCounterMode; the op has a formula).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten
_VF = torch._C._VariableFunctions

DIRECT: dict[Any, Callable[..., Any]] = {
    aten.linear.default: torch._C._nn.linear,
    aten.addmm.default: _VF.addmm,
    aten.mm.default: _VF.mm,
    aten.bmm.default: _VF.bmm,
    aten.matmul.default: _VF.matmul,
    aten.t.default: _VF.t,
    aten.view.default: torch.Tensor.view,
    aten.reshape.default: _VF.reshape,
    aten.transpose.int: _VF.transpose,
    aten.permute.default: _VF.permute,
    aten.unsqueeze.default: _VF.unsqueeze,
    aten.expand.default: torch.Tensor.expand,
    aten.split.Tensor: _VF.split,
    aten.add.Tensor: _VF.add,
    aten.sub.Tensor: _VF.sub,
    aten.mul.Tensor: _VF.mul,
    aten.div.Tensor: _VF.div,
    aten.neg.default: _VF.neg,
    aten.rsqrt.default: _VF.rsqrt,
    aten.tanh.default: _VF.tanh,
    aten.pow.Tensor_Scalar: _VF.pow,
    aten.mean.dim: _VF.mean,
    aten.layer_norm.default: _VF.layer_norm,
    aten.gelu.default: torch._C._nn.gelu,
    aten.silu.default: torch._C._nn.silu,
    aten.embedding.default: _VF.embedding,
    aten.softmax.int: _VF.softmax,
    aten.cat.default: _VF.cat,
}


def direct_calls(stage: fx.GraphModule) -> fx.GraphModule:
    """A copy of `stage` (same parameters, buffers and submodules; its own graph) whose nodes
    call `DIRECT`'s entries; `stage` itself when none applies."""
    if not any(_direct(n) for n in stage.graph.nodes):
        return stage
    graph = fx.Graph()
    graph.output(graph.graph_copy(stage.graph, {}))  # nodes' meta copied shallowly
    graph._codegen = copy.copy(stage.graph._codegen)  # an exported stage's pytree info
    for node in graph.nodes:
        if _direct(node):
            node.target = DIRECT[node.target]
    return fx.GraphModule(stage, graph, type(stage).__name__)


def _direct(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in DIRECT
