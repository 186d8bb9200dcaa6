"""Split a stage's backward into B (input gradients) and W (weight gradients).

`split_backward(stage)` rewrites a stage's graph so that every product of an activation with a
weight parameter defers its weight gradient: each call of an `nn.Linear` module (a torch.fx
stage) and each `linear`, `addmm` (Hugging Face's `Conv1D`), `mm` or `matmul` whose weight is a
parameter, possibly transposed, with no bias or a parameter bias (an exported stage) becomes a
call of `split_linear`. Its autograd backward returns only dX and queues (x, dY) under the
current micro-batch. Then:

- `B(stage, mb, outputs, grad_outputs, inputs)` runs autograd backward through the stage:
  input gradients, plus the weight gradients of everything else (norms, embeddings,
  convolutions: computed right away rather than deferred), while the queued dW/db wait.
- `W(stage, mb)` runs the queued dW and db GEMMs of that micro-batch and accumulates them
  into `.grad` (under bf16 training, into the fp32 `main_grad`: runtime/precision.py).

Between B and W a micro-batch holds the inputs and output gradients of those products (Qi et
al.'s M_W). Outside `B` (a plain `loss.backward()`), the weight gradient is computed
immediately, so a split stage still trains correctly under an unsplit schedule.

Exactness: dW and db are computed with the same GEMM and reduction torch's own backward uses,
so each micro-batch's gradients are bit-identical to plain autograd; accumulating two
micro-batches is also bit-identical in any order (floating-point addition is commutative);
three or more may differ in the last bit when W runs in a different order than B (addition is
not associative).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from pipec.runtime.precision import add_grad
from pipec.runtime.stash import tensors_nbytes

_QUEUE_ATTR = "weight_grad_queue"
aten = torch.ops.aten


@dataclass(frozen=True)
class _Form:
    """One way of multiplying an activation by a weight: the forward, and whether the weight
    is stored (out, in) as nn.Linear's (y = x Wᵀ) or (in, out) as Conv1D's (y = x W)."""

    op: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    out_in: bool


FORMS = {
    "linear": _Form(F.linear, True),
    "addmm": _Form(lambda x, w, b: torch.addmm(b, x, w), False),
    "mm": _Form(lambda x, w, b: torch.mm(x, w), False),
    "matmul": _Form(lambda x, w, b: torch.matmul(x, w), False),
    "mm_t": _Form(lambda x, w, b: torch.mm(x, w.t()), True),
    "matmul_t": _Form(lambda x, w, b: torch.matmul(x, w.t()), True),
}


@dataclass(frozen=True, slots=True)
class _Deferred:
    """The weight-gradient work of one product: parameters, form, input and output gradient."""

    weight: Tensor
    bias: Tensor | None
    out_in: bool
    x: Tensor
    dy: Tensor


class WeightGradQueue:
    """Deferred weight-gradient work of one stage, keyed by micro-batch."""

    def __init__(self) -> None:
        self._pending: dict[int, list[_Deferred]] = {}
        self._collecting: int | None = None
        self.native = False  # forwards run the plain products (see `unsplit`)

    @contextmanager
    def collect(self, mb: int) -> Iterator[None]:
        """Within this context, split products' backwards queue their work under `mb`."""
        if mb in self._pending:
            raise RuntimeError(f"B for micro-batch {mb} ran twice without W in between")
        self._pending[mb] = []
        self._collecting = mb
        try:
            yield
        finally:
            self._collecting = None

    def defer(self, work: _Deferred) -> None:
        """Queue `work` under the collecting micro-batch, or apply it now."""
        if self._collecting is None:
            _accumulate_weight_grad(work)
        else:
            self._pending[self._collecting].append(work)

    def run(self, mb: int) -> None:
        """Compute and accumulate the queued weight gradients of `mb`, freeing (x, dY)."""
        if mb not in self._pending:
            raise RuntimeError(f"W for micro-batch {mb} before its B (pending: {self.pending})")
        for work in self._pending.pop(mb):
            _accumulate_weight_grad(work)

    def held_bytes(self, mb: int) -> int:
        """Bytes the queued work of `mb` keeps alive until W: its inputs and output gradients."""
        return tensors_nbytes([t for w in self._pending.get(mb, ()) for t in (w.x, w.dy)])

    @property
    def pending(self) -> list[int]:
        """Micro-batches whose B ran and W did not, in B order."""
        return list(self._pending)


class _SplitLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, queue, form):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        # The parameters themselves, not saved tensors: under saved-tensor hooks (the runtime's
        # stash) a saved tensor comes back as another object, and W accumulates into `.grad`.
        ctx.weight, ctx.bias = weight, bias
        ctx.queue, ctx.out_in = queue, FORMS[form].out_in
        return FORMS[form].op(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight if ctx.out_in else weight.t())
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # Detached: x comes back with its history, which reaches the stage inputs (and
            # the gradients B gives them); W needs only x's values.
            ctx.queue.defer(_Deferred(weight, bias, ctx.out_in, x.detach(), dy))
        return dx, None, None, None, None


def split_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, queue: WeightGradQueue, form: str
) -> Tensor:
    """`FORMS[form].op(x, weight, bias)` whose weight gradient waits for W (see the module)."""
    if queue.native:
        return FORMS[form].op(x, weight, bias)
    return _SplitLinearFunction.apply(x, weight, bias, queue, form)


@torch.no_grad()
def _accumulate_weight_grad(work: _Deferred) -> None:
    # The reductions torch's own backward performs (mm backward on the flattened input, bias
    # gradient as a sum over the flattened rows), so results are bit-identical. Without grad
    # mode: a recorded GEMM would make each .grad hold x and dY (and W's own graph) until the
    # gradients are zeroed.
    x2 = work.x.reshape(-1, work.x.shape[-1])
    dy2 = work.dy.reshape(-1, work.dy.shape[-1])
    grads = [(work.weight, dy2.t().mm(x2) if work.out_in else x2.t().mm(dy2))]
    if work.bias is not None:
        grads.append((work.bias, dy2.sum(0)))
    for p, g in grads:
        if p.requires_grad:
            add_grad(p, g)


def split_backward(stage: fx.GraphModule) -> WeightGradQueue:
    """Route the products of `stage`'s activations with its parameters through `split_linear`
    (see the module docstring); return the stage's queue.

    The graph is rewritten; parameters and their names are unchanged, and no module is
    replaced (modules may be shared with the model). Idempotent: a stage already split
    returns its existing queue.
    """
    existing = getattr(stage, _QUEUE_ATTR, None)
    if isinstance(existing, WeightGradQueue):
        return existing
    queue = WeightGradQueue()
    object.__setattr__(stage, _QUEUE_ATTR, queue)  # a plain attribute, not a submodule
    graph = stage.graph
    queue_node = None
    for node in list(graph.nodes):
        match = _product(stage, node)
        if match is None:
            continue
        if queue_node is None:
            with (
                graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")),
                warnings.catch_warnings(),  # fx expects a tensor or module; a queue is neither
            ):
                warnings.simplefilter("ignore", UserWarning)
                queue_node = graph.get_attr(_QUEUE_ATTR)
        with graph.inserting_before(node):
            args = [graph.get_attr(a) if isinstance(a, str) else a for a in match[1:]]
            split = graph.call_function(split_linear, (*args, queue_node, match[0]))
        split.meta = node.meta
        node.replace_all_uses_with(split)
        graph.erase_node(node)
    graph.eliminate_dead_code()  # transposes of weights now unused
    stage.recompile()
    return queue


# call_function targets of a product with a weight: form, and where x, weight, bias are.
_PRODUCTS: dict[object, tuple[str, int, int, int | None]] = {
    aten.linear.default: ("linear", 0, 1, 2),
    F.linear: ("linear", 0, 1, 2),
    aten.addmm.default: ("addmm", 1, 2, 0),
    torch.addmm: ("addmm", 1, 2, 0),
    aten.mm.default: ("mm", 0, 1, None),
    torch.mm: ("mm", 0, 1, None),
    aten.matmul.default: ("matmul", 0, 1, None),
    torch.matmul: ("matmul", 0, 1, None),
    operator.matmul: ("matmul", 0, 1, None),
}
_TRANSPOSES = {aten.t.default, torch.t}

_Operand = fx.Node | str | None  # a node, or the qualified name of a parameter to read


def _product(gm: fx.GraphModule, node: fx.Node) -> tuple[str, fx.Node, _Operand, _Operand] | None:
    """(form, x, weight, bias) when `node` multiplies an activation by a parameter: a call of
    an `nn.Linear` module (weight and bias by name) or one of `_PRODUCTS`."""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
            bias = f"{node.target}.bias" if module.bias is not None else None
            return "linear", node.args[0], f"{node.target}.weight", bias  # type: ignore[return-value]
        return None
    if node.op != "call_function" or node.target not in _PRODUCTS or node.kwargs:
        return None
    form, xi, wi, bi = _PRODUCTS[node.target]
    args = node.args
    if len(args) <= max(xi, wi) or (form == "addmm" and len(args) != 3):  # addmm: no beta/alpha
        return None
    x, weight = args[xi], args[wi]
    bias = args[bi] if bi is not None and bi < len(args) else None
    if form in ("mm", "matmul") and isinstance(weight, fx.Node) and weight.target in _TRANSPOSES:
        form, weight = f"{form}_t", weight.args[0]
    if not (_is_param(gm, weight) and (bias is None or _is_param(gm, bias))):
        return None
    if not isinstance(x, fx.Node) or _is_param(gm, x):
        return None
    return form, x, weight, bias  # type: ignore[return-value]


def _is_param(gm: fx.GraphModule, node: object) -> bool:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    owner, _, name = str(node.target).rpartition(".")
    return isinstance(getattr(gm.get_submodule(owner) if owner else gm, name), nn.Parameter)


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
