"""Trace a model with torch.fx, turning tracing failures into one-line user errors.

`trace(spec)` is `torch.fx.symbolic_trace` with the spec's concrete arguments and leaf modules,
plus `runtime.kernels.attention` recorded as one call. When tracing fails, `FrontendError` names
the module being traced, the file:line of the user code that failed, and the fix.
"""

from __future__ import annotations

import linecache
import operator
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn

from pipec.frontend.spec import FrontendError, ModelSpec

_TORCH_DIR = str(Path(torch.__file__).parent)
_FRONTEND_DIR = str(Path(__file__).parent)


class _Tracer(torch.fx.Tracer):
    """A Tracer that remembers which module was being traced when an exception escaped."""

    def __init__(
        self,
        leaf_modules: tuple[type[nn.Module], ...],
        autowrap_functions: tuple[Callable[..., Any], ...],
    ) -> None:
        super().__init__(autowrap_functions=autowrap_functions)
        self._leaf_types = leaf_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self._leaf_types) or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):  # type: ignore[no-untyped-def]
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:
            # The innermost module sets it first; outer modules leave it alone.
            if not hasattr(e, "_pipec_module"):
                e._pipec_module = (self.path_of_module(m), type(m).__name__)  # type: ignore
            raise


def trace(spec: ModelSpec) -> torch.fx.GraphModule:
    """Symbolically trace `spec.model`; raise `FrontendError` with the location and fix on failure.

    Guarantees: every node of the returned graph module carries `meta["nn_module_stack"]` when
    it was created inside a submodule (the partitioner relies on it).
    """
    model = spec.model
    tracer = _Tracer(tuple(spec.leaf_modules), _autowrapped())
    try:
        graph = tracer.trace(model, concrete_args=spec.concrete_args)
    except Exception as e:
        raise FrontendError(_explain(e, model)) from e
    _drop_guarded_placeholders(graph)
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


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
        from runtime.kernels import attention
    except ImportError:  # pipec used without its runtime package: nothing to wrap
        return ()
    return (attention,)


def _explain(e: Exception, model: nn.Module) -> str:
    """One line: which module, which file:line, what went wrong, what to do."""
    path, type_name = getattr(e, "_pipec_module", ("", type(model).__name__))
    module = f"module '{path}' ({type_name})" if path else f"the top-level module ({type_name})"
    frame = _user_frame(e)
    where = f"{frame.filename}:{frame.lineno}" if frame else "unknown location"
    code = linecache.getline(frame.filename, frame.lineno).strip() if frame else ""
    quoted = f" `{code}`" if code else ""
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, torch.fx.proxy.TraceError) and "control flow" in message:
        if code.startswith("assert"):
            what = (
                "a Python assert on a traced value",
                "remove the assert or pass a concrete argument (ModelSpec.concrete_args)",
            )
        else:
            what = (
                "control flow depends on a traced value",
                "move the branch out or pass a concrete argument (ModelSpec.concrete_args)",
            )
    elif isinstance(e, TypeError) and ("slice indices" in message or "indices must be" in message):
        what = (
            "a tensor is sliced by a traced size",
            "slice with a constant, or mark the module a leaf (ModelSpec.leaf_modules)",
        )
    else:
        what = (
            f"{type(e).__name__}: {message}",
            "make the failing code traceable, or mark the module a leaf (ModelSpec.leaf_modules)",
        )
    return f"cannot trace {module} at {where}:{quoted} {what[0]}; {what[1]}"


def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch and pipec.frontend: the user's failing line."""
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith((_TORCH_DIR, _FRONTEND_DIR)) and not f.filename.startswith("<")
    ]
    return frames[-1] if frames else None
