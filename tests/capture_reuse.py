"""Capture each model once per rank process, not once per case (tests only).

A rank of tests/runtime_harness.py prepares dozens of builds of the same few models, and each
`Rank.prepare` captures its model again: torch.export of the tiny GPT takes ~1.5 s of a core,
~70% of a 4-rank harness launch on 2 cores. `reuse_captures()` keeps the first capture of each
(spec, seed, capture, device, micro-batch size) and answers later ones with the same graph over
the parameters of a freshly built factory model: the same values (same seed), new tensors, so
cases never share parameters (nor BitPipe's two replicas theirs). A graph that differed, or a
parameter bound wrong, would fail the harness's own checks against the single-process
reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import fx

from pipec.frontend import plan as frontend
from pipec.frontend.precision import at_dtype
from pipec.frontend.spec import ModelSpec, load_factory
from pipec.frontend.stages import _attr  # a dotted attribute, as split reads it


def _rebound(first: frontend._Traced, ms: ModelSpec, dtype: torch.dtype | None) -> frontend._Traced:
    """`first`'s graph over `ms.model`'s parameters, buffers and modules (cast to `dtype` when
    captured at it, as `_trace` leaves them; constants the model does not hold, such as
    export's lifted ones, are read-only and come from `first`)."""
    source = ms.model if dtype is None else at_dtype(ms, dtype).model
    attrs = {}
    for node in first.gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            try:
                attrs[target] = _attr(source, target)
            except AttributeError:
                attrs[target] = _attr(first.gm, target)
    gm = fx.GraphModule(attrs, first.gm.graph, type(first.gm).__name__)
    finer = first.finer and replace(first.finer, spec=ms, gm=gm)  # the same graph cut deeper
    return replace(first, spec=ms, gm=gm, finer=finer)


def reusing(capture: Callable[..., frontend._Traced]) -> Callable[..., frontend._Traced]:
    """`capture` (pipec.frontend.plan._trace), answering a repeated call from the first."""
    firsts: dict[tuple, frontend._Traced] = {}

    def traced(
        spec, seed, capture_mode=None, device=None, micro_batch_size=None, fits=None, dtype=None
    ):  # type: ignore[no-untyped-def]
        args = (spec, seed, capture_mode, device, micro_batch_size, fits)
        if not isinstance(spec, str):
            return capture(*args, dtype=dtype)
        key = (spec, seed, capture_mode, str(device), micro_batch_size, fits, dtype)
        first = firsts.get(key)
        if first is None:
            firsts[key] = first = capture(*args, dtype=dtype)
            return first
        ms = load_factory(spec, seed, micro_batch_size)
        if device is not None:
            from pipec.frontend.profile import on_device

            ms = on_device(ms, str(device))
        return _rebound(first, ms, dtype)

    return traced


def reuse_captures() -> None:
    """From now on, this process captures each model once (a rank of the harness)."""
    frontend._trace = reusing(frontend._trace)
