"""runtime/direct.py: a stage executed through torch's bindings and the direct attention
computes what the captured graph computes, bit for bit where the kernels are the same."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import fx

from pipec.frontend import build_stages
from pipec.runtime.direct import DIRECT, direct_calls
from pipec.runtime.kernels.attention import direct

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[1]


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


# One call of every ATen overload DIRECT replaces: (args, kwargs) as torch.export records them.
CALLS = {
    aten.linear.default: lambda: ((_t(3, 4), _t(5, 4), _t(5)), {}),
    aten.addmm.default: lambda: ((_t(5), _t(3, 4), _t(4, 5)), {}),
    aten.mm.default: lambda: ((_t(3, 4), _t(4, 5)), {}),
    aten.bmm.default: lambda: ((_t(2, 3, 4), _t(2, 4, 5)), {}),
    aten.matmul.default: lambda: ((_t(2, 3, 4), _t(4, 5)), {}),
    aten.t.default: lambda: ((_t(3, 4),), {}),
    aten.view.default: lambda: ((_t(3, 4), [4, 3]), {}),
    aten.reshape.default: lambda: ((_t(3, 4), [2, 6]), {}),
    aten.transpose.int: lambda: ((_t(2, 3, 4), 1, 2), {}),
    aten.permute.default: lambda: ((_t(2, 3, 4), [2, 0, 1]), {}),
    aten.unsqueeze.default: lambda: ((_t(3, 4), 1), {}),
    aten.expand.default: lambda: ((_t(3, 1), [3, 4]), {}),
    aten.split.Tensor: lambda: ((_t(6, 4), 2, 0), {}),
    aten.add.Tensor: lambda: ((_t(3, 4), _t(3, 4)), {"alpha": 2}),
    aten.sub.Tensor: lambda: ((_t(3, 4), 1.5), {}),
    aten.mul.Tensor: lambda: ((_t(3, 4), _t(4)), {}),
    aten.div.Tensor: lambda: ((_t(3, 4), 3.0), {}),
    aten.neg.default: lambda: ((_t(3, 4),), {}),
    aten.rsqrt.default: lambda: ((_t(3, 4).abs().detach().requires_grad_(),), {}),
    aten.tanh.default: lambda: ((_t(3, 4),), {}),
    aten.pow.Tensor_Scalar: lambda: ((_t(3, 4), 2), {}),
    aten.mean.dim: lambda: ((_t(3, 4), [-1], True), {}),
    aten.layer_norm.default: lambda: ((_t(3, 4), [4], _t(4), _t(4), 1e-5), {}),
    aten.gelu.default: lambda: ((_t(3, 4),), {"approximate": "tanh"}),
    aten.silu.default: lambda: ((_t(3, 4),), {}),
    aten.embedding.default: lambda: ((_t(10, 4), torch.tensor([[1, 2], [3, 9]])), {}),
    aten.softmax.int: lambda: ((_t(3, 4), -1), {}),
    aten.cat.default: lambda: (([_t(3, 4), _t(2, 4)], 0), {}),
}


def _leaves(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]  # type: ignore[list-item]


def test_every_binding_computes_its_overload_with_the_same_autograd_node() -> None:
    aten_entries = {op for op in DIRECT if isinstance(op, torch._ops.OpOverload)}
    aten_entries -= {op for op in aten_entries if op.namespace != "aten"}
    assert aten_entries == set(CALLS), "every ATen entry of DIRECT has a call here"
    for op, make in CALLS.items():
        torch.manual_seed(0)
        args, kwargs = make()
        want = _leaves(op(*args, **kwargs))
        got = _leaves(DIRECT[op](*args, **kwargs))
        assert len(got) == len(want), op
        for g, w in zip(got, want):
            assert torch.equal(g, w), op
            assert type(g.grad_fn) is type(w.grad_fn), (op, g.grad_fn, w.grad_fn)


def test_direct_attention_equals_the_op_bit_for_bit_on_the_cpu_flash_kernel() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 4, 32, 16)
    op_out = torch.ops.pipec.attention(q, k, v, True, None)[0]
    op_grads = torch.autograd.grad(op_out, (q, k, v), do)
    out = direct(q, k, v, True, None)[0]
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert torch.equal(out, op_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, op_grads))


def test_direct_attention_with_grouped_heads_matches_the_op() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    op_out = torch.ops.pipec.attention(q, k, v, False, 0.3)[0]
    out = direct(q, k, v, False, 0.3)[0]
    torch.testing.assert_close(out, op_out)
    for a, b in zip(
        torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(op_out.sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b)


def test_a_direct_stage_is_a_copy_with_equal_gradients() -> None:
    from pipec.model import compile_model

    plan = compile_model(f"{ROOT}/examples/gpt.py:tiny", "1f1b", 2, 4).plan
    stage = build_stages(None, plan["model"], [0])[0]  # already direct
    ops = {n.target for n in stage.graph.nodes if n.op == "call_function"}
    assert torch.ops.pipec.attention.default not in ops and direct in ops
    assert not any(isinstance(t, torch._ops.OpOverload) and t in DIRECT for t in ops)
    # The captured form of the same stage: the op, and the overloads.
    captured = fx.GraphModule(stage, _undirect(stage.graph), "Captured")
    x = torch.randint(0, 128, (2, 32))
    grads = []
    for module in (captured, stage):
        for p in stage.parameters():
            p.grad = None
        (module(x) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in stage.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert direct_calls(captured) is not captured and direct_calls(stage) is stage


def _undirect(graph: fx.Graph) -> fx.Graph:
    back = {v: k for k, v in DIRECT.items() if not isinstance(k, torch._ops.OpOverloadPacket)}
    back[direct] = torch.ops.pipec.attention.default
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    copy._codegen = graph._codegen
    for node in copy.nodes:
        if node.op == "call_function" and node.target in back:
            node.target = back[node.target]
    return copy
