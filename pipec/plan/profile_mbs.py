"""Profile the model's blocks at micro-batch sizes 1, 2, 4, … on the local device.

A factory that takes the `micro_batch_size` keyword gives each size's micro-batch itself, as
a build at that size will ask it. Otherwise the factory hands pipec ONE example micro-batch,
and a micro-batch of n samples is built from it by taking its samples cyclically along dim 0 —
every input and the target — so n below the example's size is a slice and n above it repeats
the example; dim 0 must be the batch dimension of all of them. Repeated samples cost what
fresh ones would: nothing is cached.

Each size captures the blocks anew (torch.export specializes a graph to the example's sizes),
times F, B and W of every block with the runtime's B/W split (the frontend's profiler) in
`runs` rounds and keeps each op's median, measures each block's stash and the bytes of its
boundary (any number of values), and on CPU what a micro-batch holds beside its stash
(autograd's host records, what B leaves for W: the terms the CPU meter sees; measured at the
first size, `_extras_of`). It stops early when the next size would not fit in the time budget
or in the device's free memory (or runs out of it). MFU needs the device's peak:
`--peak-tflops`, or a large matrix multiplication timed here.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from pipec.frontend import (
    FrontendError,
    ModelSpec,
    build_model_plan,
    load_factory,
    measure_stash_bytes,
    split_model,
)
from pipec.frontend.blocks import find_blocks
from pipec.frontend.profile import ProgressBar, _now, on_device, profile_stages
from pipec.frontend.spec import takes_micro_batch_size
from pipec.ir import PipecError
from pipec.plan.conditions import current
from pipec.plan.facts import FBW, BlockFacts, MbsPoint, ModelProfile
from pipec.runtime.direct import direct_calls

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
"""How the conditions name the model's dtype."""
MEMORY_HEADROOM = 0.5
"""Profile a size only while its activations take at most this share of free memory."""
EXTRAS_HELD = 8
"""Forwards held alive per batch when measuring a block's host bytes (`module_extras`)."""


def resize(ms: ModelSpec, mbs: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """The example micro-batch's inputs and target with `mbs` samples (see the module doc)."""
    tensors = (*ms.example_inputs, ms.example_target)
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if len(sizes) != 1 or None in sizes:
        raise PipecError(
            "cannot build micro-batches of other sizes: the example inputs and target must share "
            f"their batch size in dim 0 (got {[tuple(t.shape) for t in tensors]})"
        )
    index = torch.arange(mbs, device=tensors[0].device) % sizes.pop()
    *inputs, target = (t[index] for t in tensors)
    return tuple(inputs), target


@dataclass(frozen=True)
class Sized:
    """A model spec whose example micro-batch has the size being profiled, and its blocks."""

    spec: ModelSpec
    blocks: list[torch.nn.Module]


def at_size(spec: str, ms: ModelSpec, sized: bool, mbs: int, n_blocks: int) -> Sized:
    """The model's blocks and one micro-batch of `mbs` samples: the factory's own model and
    micro-batch at that size where it takes the keyword (`sized`), else `ms` with its example
    resized; on the device of `ms` (where `--device` moved it). The blocks are captured at
    this size (torch.export bakes the example's sizes into the graph it captures), and run as
    the runtime runs them (`direct_calls`)."""
    try:
        if sized:
            at = load_factory(spec, micro_batch_size=mbs)
            at = on_device(at, str(ms.example_inputs[0].device))
        else:
            inputs, target = resize(ms, mbs)
            at = replace(ms, example_inputs=inputs, example_target=target)
        blocks = [direct_calls(b) for b in split_model(at, n_blocks, [1] * n_blocks)]
    except FrontendError as e:
        raise PipecError(str(e)) from None
    return Sized(at, blocks)


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """FLOP/s of the best of a few n×n matrix multiplications in `dtype`, and how measured."""
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for run in range(6):
        t0 = _now(device)
        a @ b
        if run:  # the first is a warm-up
            best = min(best, _now(device) - t0)
    dt = str(dtype).removeprefix("torch.")
    return 2 * n**3 / best, f"measured: best {dt} {n}x{n} GEMM on {device.type}"


def profile_model(
    spec: str,
    sizes: Sequence[int],
    *,
    time_budget: float,
    runs: int = 3,
    peak_flops: float | None = None,
    progress: bool = True,
    device: str | None = None,
    p: int = 1,
) -> ModelProfile:
    """Profile `spec`'s blocks at each size in `sizes` (ascending) until time or memory stops,
    on `device` (`--device`; default: where the factory builds the model); a model with fewer
    blocks than the `p` stages of a plan is refused before any of it."""
    try:
        ms = load_factory(spec)
        ms = ms if device is None else on_device(ms, device)
        sized = takes_micro_batch_size(spec)
        n_blocks = find_blocks(ms.model).n_blocks
        if n_blocks < p:
            raise PipecError(
                f"{spec} has {n_blocks} blocks and --pp {p} needs at least one per stage; "
                f"use --pp {n_blocks} or fewer"
            )
        one_each = [1] * n_blocks
        facts = build_model_plan(ms, n_blocks, one_each, progress=False)
    except FrontendError as e:
        raise PipecError(str(e)) from None
    device = ms.example_inputs[0].device
    if device.type == "meta":
        raise PipecError(f"{spec} builds its model on the meta device; plan needs a runnable one")
    host = device.type == "cpu"  # the CPU meter counts autograd's host records and W's hold
    example = ms.example_inputs[0].shape[0]
    load = os.getloadavg()[0]  # before the sweep loads the machine itself
    t0 = time.perf_counter()
    first = at_size(spec, ms, sized, sizes[0], n_blocks)
    capture_dt = time.perf_counter() - t0
    block_facts = tuple(
        BlockFacts(
            s.params,
            s.param_bytes,
            FBW(*(getattr(s.flops, k) / example for k in "FBW")),
            _optimizer_step(block, runs),
        )
        for s, block in zip(facts.stages, first.blocks)
    )
    if peak_flops is None:
        dtype = next(p.dtype for p in ms.model.parameters() if p.is_floating_point())
        peak_flops, source = measure_peak_flops(device, dtype)
    else:
        source = "--peak-tflops"
    label = "profiling F/B/W per micro-batch size"
    bar = ProgressBar(len(sizes), label, sys.stderr) if progress else None
    _measure(first, sizes[0], 1, extras=False)  # warm-up: first calls pay one-time set-up
    points: list[MbsPoint] = []
    stopped, start, work_dt = "", time.perf_counter(), 0.0
    for mbs in sizes:
        if points and not stopped:
            grow = mbs / points[-1].mbs
            elapsed = time.perf_counter() - start
            # A size's capture costs about the same at any size; its timing runs grow with it.
            if elapsed + capture_dt + work_dt * grow > time_budget:
                stopped = f"time budget ({time_budget:g} s) before mbs {mbs}"
            elif _activation_bytes(points[-1]) * grow > MEMORY_HEADROOM * _free_bytes(device):
                stopped = f"free memory before mbs {mbs}"
        if not stopped:
            t0 = time.perf_counter()
            try:
                if mbs == sizes[0]:
                    sized_at = first
                else:
                    sized_at = at_size(spec, ms, sized, mbs, n_blocks)
                    capture_dt = time.perf_counter() - t0
                point, work_dt = _measure(sized_at, mbs, runs, extras=host and not points)
                points.append(_extras_of(points[0], point) if host and points else point)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                stopped = f"out of memory at mbs {mbs}"
        if bar:
            bar.advance()
    if not points:
        raise PipecError(f"could not profile {spec} even at micro-batch size {sizes[0]}: {stopped}")
    dtype = next((p.dtype for p in ms.model.parameters() if p.is_floating_point()), None)
    conditions = current(torch.get_num_threads(), 1, DTYPES.get(dtype, str(dtype)), device.type)
    return ModelProfile(
        name=spec,
        blocks=block_facts,
        points=tuple(points),
        tokens_per_sample=ms.example_inputs[0].numel() // example,
        peak_flops=peak_flops,
        peak_source=source,
        stopped=stopped,
        factory_sized=sized,
        device=device.type,
        conditions=replace(conditions, load=load),
    )


def _measure(sized: Sized, mbs: int, runs: int, extras: bool) -> tuple[MbsPoint, float]:
    """One size: every block's boundary input, stash bytes and median F/B/W seconds on the
    example micro-batch of `sized` (`mbs` samples); with `extras` (a CPU profile), what each
    block's micro-batch holds beyond its stash (`module_extras`: autograd's host records, and
    the tensors B leaves for W). Also the seconds it took less the extras', measured once: the
    part of the sweep's time that grows with the size."""
    t0 = time.perf_counter()
    ms, blocks = sized.spec, sized.blocks
    boundaries = [tuple(ms.example_inputs)]
    with torch.no_grad():
        for block in blocks[:-1]:
            y = block(*boundaries[-1])
            boundaries.append((y,) if isinstance(y, Tensor) else tuple(y))

    def loss(out: Tensor) -> Tensor:
        return ms.loss_fn(out, ms.example_target)

    last = len(blocks) - 1
    stash = tuple(
        measure_stash_bytes(b, x, loss if k == last else None)
        for k, (b, x) in enumerate(zip(blocks, boundaries))
    )
    t1 = time.perf_counter()
    host, fused_host, w_held = _extras(blocks, boundaries, loss, stash) if extras else ((),) * 3
    t2 = time.perf_counter()
    # Rounds run every block once (the first is a warm-up), so a burst of load from other
    # processes hits one round of many blocks rather than every run of one; the median round
    # of each op is its cost as the sweep saw it (a calibration run scales it to a run's).
    rounds = [
        profile_stages(blocks, boundaries, loss, runs=1, warmup=0, progress=False)
        for _ in range(runs + 1)
    ][1:]
    fused = [_fused_backward(blocks, boundaries, loss) for _ in range(runs + 1)][1:]
    point = MbsPoint(
        mbs=mbs,
        seconds=tuple(
            FBW(*(statistics.median(getattr(r[k], op) for r in rounds) for op in "FBW"))
            for k in range(len(blocks))
        ),
        stash_bytes=stash,
        input_bytes=tuple(sum(t.untyped_storage().nbytes() for t in x) for x in boundaries),
        message_bytes=tuple(message_bytes(x) for x in boundaries),
        fused_backward=tuple(statistics.median(r[k] for r in fused) for k in range(len(blocks))),
        host_bytes=host,
        fused_host_bytes=fused_host,
        w_held_bytes=w_held,
    )
    return point, (t1 - t0) + (time.perf_counter() - t2)


def message_bytes(values: Sequence[Tensor]) -> int:
    """Bytes of the floating values of a block boundary: what a stage boundary there sends
    (and a gradient brings back), as the build's plan.json counts its stage outputs."""
    return sum(t.numel() * t.element_size() for t in values if t.is_floating_point())


def _extras_of(first: MbsPoint, point: MbsPoint) -> MbsPoint:
    """`point` with the extras measured at the first size: autograd's host records are the
    same at any batch size (nodes and tensor headers, not data), and what B leaves for W is
    tensors of the batch, which grow with it. Measured once, they cost the sweep little."""
    scale = point.mbs / first.mbs
    w_held = tuple(round(w * scale) for w in first.w_held_bytes)
    return replace(
        point,
        host_bytes=first.host_bytes,
        fused_host_bytes=first.fused_host_bytes,
        w_held_bytes=w_held,
    )


def _extras(
    blocks: list[torch.nn.Module],
    boundaries: list[tuple[Tensor, ...]],
    loss: Callable[[Tensor], Tensor],
    stash: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per block, what one micro-batch holds beside its stash, as the runtime's prediction
    measures a stage (`module_extras`): the host bytes with the B/W split and with native
    Linears (a BW schedule's stages are not split), and what B leaves for W."""
    from pipec.runtime.bwsplit import unsplit
    from pipec.runtime.meter import module_extras

    last = len(blocks) - 1
    host, fused, w_held = [], [], []
    for k, (block, x) in enumerate(zip(blocks, boundaries)):
        score = loss if k == last else None
        h, w = module_extras(block, x, score, stash[k], split=True, held=EXTRAS_HELD)
        with unsplit(block, True):
            fused.append(module_extras(block, x, score, stash[k], False, EXTRAS_HELD)[0])
        host.append(h)
        w_held.append(w)
    return tuple(host), tuple(fused), tuple(w_held)


def _fused_backward(
    blocks: list, boundaries: list[tuple[Tensor, ...]], loss: Callable[[Tensor], Tensor]
) -> list[float]:  # type: ignore[type-arg]
    """One round of every block's fused backward: B and W in one autograd pass, what the
    runtime runs for BW (weight gradients applied at once, outside the split's queue). It
    costs less than the split B plus W, which pay the deferral."""
    out = []
    last = len(blocks) - 1
    for k, (block, inputs) in enumerate(zip(blocks, boundaries)):
        leaves = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
        y = block(*leaves)
        if k == last:
            outputs, grads = [loss(y)], None
        else:  # a boundary may carry several values, some not differentiable (a mask)
            outputs = [t for t in pytree.tree_leaves(y) if t.requires_grad]
            grads = [torch.ones_like(t) for t in outputs]
        t0 = _now(leaves[0].device)
        torch.autograd.backward(outputs, grads)
        out.append(_now(leaves[0].device) - t0)
        for p in block.parameters():
            p.grad = None
    return out


def _optimizer_step(block: torch.nn.Module, runs: int) -> float:
    """Seconds of the runtime's AdamW step over the block's parameters (median of `runs`
    after a warm-up), on copies: the block itself is left as it was."""
    params = [p.detach().clone().requires_grad_(True) for p in block.parameters()]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    times = []
    for run in range(runs + 1):
        t0 = _now(params[0].device)
        opt.step()
        if run:
            times.append(_now(params[0].device) - t0)
    return statistics.median(times)


def _activation_bytes(point: MbsPoint) -> int:
    """What profiling a size holds at once: every boundary, and the largest block stash (the
    extras, which hold more, are measured at the first size only)."""
    return sum(point.input_bytes) + max(point.stash_bytes)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
