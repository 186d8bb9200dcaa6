"""Capture a model as one fx graph: torch.export, or torch.fx symbolic tracing.

`export(spec)` is `torch.export.export` (non-strict): an ATen-level graph that goes through
shape arithmetic, `ModelOutput`s, Hugging Face mask builders and `torch.nn` containers, and
keeps custom ops (`torch.library.custom_op`, such as `runtime.kernels.attention`) as one node
with their own backward; parameters keep their qualified names as `get_attr` targets and every
node its `meta["nn_module_stack"]`. `trace(spec)` is `torch.fx.symbolic_trace` with the spec's
concrete arguments and leaf modules, plus `runtime.kernels.attention` recorded as one call:
module-level graphs (`call_module` of each `nn.Linear`).

Both run the model's Python once; a custom `torch.autograd.Function` applied during that run
is refused: a captured graph keeps its forward's operations and loses its backward, so the
gradients would be silently wrong. Any failure becomes `FrontendError`: the module being
captured, the file:line of the user code that failed, and the fix.
"""

from __future__ import annotations

import inspect
import io
import linecache
import logging
import operator
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.fx.config
from torch import nn

from pipec.frontend.spec import FrontendError, ModelSpec
from pipec.frontend.stages import positional

_TORCH_DIR = str(Path(torch.__file__).parent)
_FRONTEND_DIR = str(Path(__file__).parent)


class _Tracer(torch.fx.Tracer):
    """A Tracer that also treats the spec's leaf module types as leaves."""

    def __init__(
        self,
        leaf_modules: tuple[type[nn.Module], ...],
        autowrap_functions: tuple[Callable[..., Any], ...],
    ) -> None:
        super().__init__(autowrap_functions=autowrap_functions)
        self._leaf_types = leaf_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self._leaf_types) or super().is_leaf_module(m, module_qualified_name)


def trace(spec: ModelSpec) -> torch.fx.GraphModule:
    """Symbolically trace `spec.model`; raise `FrontendError` with the location and fix on failure.

    Guarantees: every node of the returned graph module carries `meta["nn_module_stack"]` when
    it was created inside a submodule (the partitioner relies on it).
    """
    model = spec.model
    tracer = _Tracer(tuple(spec.leaf_modules), _autowrapped())
    try:
        with _no_autograd_functions():
            graph = tracer.trace(model, concrete_args=spec.concrete_args)
    except Exception as e:
        raise CaptureError(*_explain(e, model, "trace")) from e
    _drop_guarded_placeholders(graph)
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def export(spec: ModelSpec) -> torch.fx.GraphModule:
    """`torch.export` `spec.model` on its example inputs; a flat ATen graph module.

    The module shares the model's parameters and keeps their names; its graph's codegen holds
    the output's pytree spec (`graph._codegen.pytree_info.out_spec`), so calling it returns
    what the model returns. Keyword arguments: the spec's `concrete_args`, and
    `use_cache=False` for a forward that takes `use_cache` (decoders of `transformers`, whose
    key/value cache is for generation, not training). Guard and metadata assertions are
    removed: they pin the capture's device and add nothing to a training step.
    """
    model = spec.model
    kwargs = dict(spec.concrete_args or {})
    if "use_cache" in inspect.signature(model.forward).parameters:
        kwargs.setdefault("use_cache", False)
    try:
        with _quiet(), _no_autograd_functions(), _no_stack_traces():
            program = torch.export.export(model, spec.example_inputs, kwargs, strict=False)
        gm = program.module()
    except Exception as e:
        raise CaptureError(*_explain(e, model, "export")) from e
    _drop_assertions(gm)
    _positional_only(gm, len(spec.example_inputs))
    _read_tied_parameters_by_owner(gm)
    gm.recompile()
    return gm


def _read_tied_parameters_by_owner(gm: torch.fx.GraphModule) -> None:
    """Read a tied parameter under the name of the module using it.

    export reads a parameter shared by two modules (a tied embedding and LM head) under one of
    its names everywhere; the stage holding the embedding would then name it after the head.
    Each use gets its own `get_attr` of the name its module (innermost `nn_module_stack`
    entry) knows it by, so every stage keeps the name its layer has in the model.
    """
    params = dict(gm.named_parameters(remove_duplicate=False))
    names: dict[int, list[str]] = {}
    for name, p in params.items():
        names.setdefault(id(p), []).append(name)
    for attr in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in params]:
        aliases = names[id(params[str(attr.target)])]
        for user in list(attr.users) if len(aliases) > 1 else []:
            stack = list((user.meta.get("nn_module_stack") or {}).values())
            owner = stack[-1][0] if stack else ""
            own = [k for k in aliases if k.rpartition(".")[0] == owner]
            if owner and own and own[0] != attr.target:
                with gm.graph.inserting_before(user):
                    renamed = gm.graph.get_attr(own[0])
                renamed.meta = dict(attr.meta)
                user.replace_input_with(attr, renamed)
        if not attr.users:
            gm.graph.erase_node(attr)


def _positional_only(gm: torch.fx.GraphModule, n_args: int) -> None:
    """Drop the placeholders of keyword arguments (export specialised them to constants), so
    that the module takes the example inputs positionally, as stages do."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph in placeholders[n_args:]:
        if ph.users:
            raise FrontendError(
                f"{type(gm).__name__}: keyword argument {ph.name!r} is read as a tensor; pass it "
                "as an example input (ModelSpec.example_inputs) instead of concrete_args"
            )
        gm.graph.erase_node(ph)
    names = [ph.name for ph in placeholders[:n_args]]
    gm.graph._codegen.pytree_info = positional(gm.graph._codegen.pytree_info, names)


class _AutogradFunctionApplied(Exception):
    """A custom `torch.autograd.Function` ran while capturing (see the module docstring)."""

    def __init__(self, function: type) -> None:
        super().__init__(f"{function.__qualname__}.apply")
        self.function = function


@contextmanager
def _no_autograd_functions() -> Iterator[None]:
    """Raise `_AutogradFunctionApplied` from the first `apply` of a `torch.autograd.Function`
    defined outside torch inside: under capture its backward would be lost. (torch's own,
    such as the one carrying a custom op's registered backward, stay in the graph as ops.)"""
    original = torch.autograd.Function.__dict__["apply"]

    def checked(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch."):
            raise _AutogradFunctionApplied(cls)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(checked)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


@contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Skip export's per-node stack traces: a quarter of its time, and nothing reads them."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's warnings and its printed graph of a failing export: a failure is
    reported in one line, by us."""
    logging.disable(logging.WARNING)
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def _drop_assertions(gm: torch.fx.GraphModule) -> None:
    """Remove export's guard call and every ATen op that returns nothing (metadata asserts)."""
    for node in list(gm.graph.nodes):
        guard = node.op == "call_module" and str(node.target).startswith("_guards")
        check = (
            node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and not node.target._schema.returns
        )
        if (guard or check) and not node.users:
            gm.graph.erase_node(node)
    gm.delete_all_unused_submodules()


_GUARDS = {operator.eq, torch._assert, torch.fx._symbolic_trace._assert_is_none}


def _drop_guarded_placeholders(graph: torch.fx.Graph) -> None:
    """Remove concrete arguments: placeholders whose only uses are fx's value guards.

    fx keeps a placeholder per concrete argument, checked by `eq`/`_assert` nodes; left in,
    it would become an input of the first stage that the example inputs do not supply.
    """
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        reached, frontier = [], list(ph.users)
        while frontier:
            node = frontier.pop()
            if node not in reached:
                reached.append(node)
                frontier.extend(node.users)
        if reached and all(n.op == "call_function" and n.target in _GUARDS for n in reached):
            for node in reversed([n for n in graph.nodes if n in reached]):
                graph.erase_node(node)
            graph.erase_node(ph)


def _autowrapped() -> tuple[Callable[..., Any], ...]:
    """Functions recorded as one node even when the user's module did not `torch.fx.wrap` them."""
    try:
        from pipec.runtime.kernels import attention
    except ImportError:  # pipec used without its runtime package: nothing to wrap
        return ()
    return (attention,)


_CONCRETE = "pass a concrete argument (ModelSpec.concrete_args)"


class CaptureError(FrontendError):
    """A model that cannot be captured: `problem` says which module, which file:line and what
    went wrong; the message adds what to do."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem


def _explain(e: Exception, model: nn.Module, how: str) -> tuple[str, str]:
    """Which module, which file:line and what went wrong; and what to do."""
    path, type_name = _failing_module(e, model)
    module = f"module '{path}' ({type_name})" if path else f"the top-level module ({type_name})"
    frame = _user_frame(e)
    where = f"{frame.filename}:{frame.lineno}" if frame else "unknown location"
    code = linecache.getline(frame.filename, frame.lineno).strip() if frame else ""
    quoted = f" `{code}`" if code else ""
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    data_dependent = "data-dependent" in message or (
        isinstance(e, torch.fx.proxy.TraceError) and "control flow" in message
    )
    if isinstance(e, _AutogradFunctionApplied):
        what = (
            (
                f"it applies the custom autograd.Function {e.function.__qualname__}, whose "
                "backward a captured graph would lose"
            ),
            (
                "make it a torch.library.custom_op with register_autograd (as "
                "pipec.runtime.kernels.attention), or capture with torch.fx "
                '(ModelSpec.capture="fx") and torch.fx.wrap the function that applies it'
            ),
        )
    elif data_dependent and code.startswith("assert"):
        what = ("a Python assert on a traced value", f"remove the assert or {_CONCRETE}")
    elif data_dependent:
        what = (
            "control flow depends on a traced value",
            f"move the branch out, use torch.cond, or {_CONCRETE}",
        )
    elif isinstance(e, TypeError) and ("slice indices" in message or "indices must be" in message):
        what = (
            "a tensor is sliced by a traced size",
            (
                "slice with a constant, mark the module a leaf (ModelSpec.leaf_modules) or "
                'capture with torch.export (ModelSpec.capture="export")'
            ),
        )
    else:
        what = (
            f"{type(e).__name__}: {message}",
            "make the failing code traceable"
            + (", or mark the module a leaf (ModelSpec.leaf_modules)" if how == "trace" else ""),
        )
    return f"cannot {how} {module} at {where}:{quoted} {what[0]}", what[1]


def _failing_module(e: BaseException, model: nn.Module) -> tuple[str, str]:
    """(qualified name, type name) of the innermost module whose forward was running."""
    names = {id(m): name for name, m in model.named_modules()}
    found = ("", type(model).__name__)
    tb = e.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = (names[id(owner)], type(owner).__name__)
        tb = tb.tb_next
    return found


def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and pipec.frontend: the user's failing line."""
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith((_TORCH_DIR, _FRONTEND_DIR)) and not f.filename.startswith("<")
    ]
    return frames[-1] if frames else None
