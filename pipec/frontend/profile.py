"""Measure each stage's F, B and W on the local device: median of several runs.

Stages are prepared with `runtime.bwsplit.split_backward`, so B and W are the same code the
runtime executes. A small progress bar on stderr shows the runs. `--device` (`on_device`) moves
the factory's model and example batch to the device the build will run on before anything is
traced or timed, so a GPU run is scheduled with GPU costs; on CUDA each timing point
synchronises the device first, so the times are the kernels' and not their launches'.

A profile taken while other processes compete for the device describes that moment, not the
run: the profile measures its own noise, the spread of each stage's timed runs, and warns on
stderr with the figure when it passes NOISE_LIMIT.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from pipec.frontend.facts import Costs
from pipec.frontend.spec import ModelSpec
from pipec.ir import PipecError
from pipec.runtime.bwsplit import B, W, split_backward

DEVICE_TYPES = ("cpu", "cuda")

NOISE_LIMIT = 0.5
"""The largest spread, (max - min) / median of one stage's timed runs (F + B + W of a run),
that --profile trusts. A quiet CPU or GPU repeats a stage within a few per cent; runs that
differ by half their median mean other work took the device for part of the timing, and a
schedule simulated from them was seen 3x off its measured run."""


def profile_device(name: str) -> torch.device:
    """The device `--device NAME` names, if this machine has it; else PipecError (one line)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise PipecError(f"--device {name}: pipec profiles on cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PipecError(
            f"--device {name}: CUDA is not available on this machine (torch "
            f"{torch.__version__} sees no GPU); profile with --device cpu, or run this command "
            "where the build will run"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise PipecError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return device


def on_device(ms: ModelSpec, name: str) -> ModelSpec:
    """`ms` with its model (in place), example inputs and target on the device `name`."""
    device = profile_device(name)
    if ms.example_inputs[0].device.type == "meta":
        raise PipecError(
            f"--device {name}: the factory builds its model on the meta device, which holds no "
            "weights to move; build it on a real device to profile it"
        )
    return replace(
        ms,
        model=ms.model.to(device),
        example_inputs=tuple(x.to(device) for x in ms.example_inputs),
        example_target=ms.example_target.to(device),
    )


class ProgressBar:
    """`[#####.....] 12/40 label` on one line of stderr; no dependencies.

    On a terminal the line is redrawn in place after every step; elsewhere (logs, CI) only the
    finished line is written, so logs get one line instead of `total` carriage returns.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30):
        # sys.stderr when drawn, not when this module was imported (it may have been replaced)
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stderr
        self.done = 0
        self._live = self.stream.isatty()
        if self._live:
            self._draw("\r")

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if self.done == self.total:
            self._draw("\r" if self._live else "")
            self.stream.write("\n")
        elif self._live:
            self._draw("\r")
        self.stream.flush()

    def _draw(self, prefix: str) -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"{prefix}[{bar}] {self.done}/{self.total} {self.label}")


def profile_stages(
    stages: list[nn.Module],
    stage_inputs: list[tuple[Tensor, ...]],
    loss: Callable[[Any], Tensor],
    runs: int = 5,
    warmup: int = 1,
    progress: bool = True,
) -> list[Costs]:
    """Median seconds of F, B, W per stage over `runs` timed runs after `warmup` untimed ones.

    `stage_inputs[k]` is one micro-batch's input to stage k; `loss` is applied to the last
    stage's output inside F (and differentiated in B). Mutates the stages (split_backward) and
    leaves their `.grad`s set to None.
    """
    device = next(iter(stage_inputs[0])).device
    if device.type == "meta":
        raise ValueError("cannot profile a model on the meta device; use the FLOP estimate")
    bar = ProgressBar(len(stages) * (warmup + runs), "profiling F/B/W") if progress else None
    results, totals = [], []
    for k, (stage, inputs) in enumerate(zip(stages, stage_inputs, strict=True)):
        split_backward(stage)
        last = k == len(stages) - 1
        times: list[tuple[float, float, float]] = []
        for run in range(warmup + runs):
            for p in stage.parameters():
                p.grad = None
            leaves = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
            t0 = _now(device)
            out = stage(*leaves)
            if last:
                out = loss(out)
            t1 = _now(device)
            outputs = [t for t in pytree.tree_leaves(out) if t.requires_grad]
            B(stage, run, outputs, None if last else [torch.ones_like(t) for t in outputs], leaves)
            t2 = _now(device)
            W(stage, run)
            t3 = _now(device)
            if run >= warmup:
                times.append((t1 - t0, t2 - t1, t3 - t2))
            if bar:
                bar.advance()
        for p in stage.parameters():
            p.grad = None
        f, b, w = (statistics.median(t[i] for t in times) for i in range(3))
        results.append(Costs(f, b, w))
        totals.append([sum(t) for t in times])
    warn_if_noisy(totals)
    return results


def spread(runs: list[float]) -> float:
    """(max - min) / median of one stage's timed runs: 0 when they agree (or there is one)."""
    middle = statistics.median(runs)
    return (max(runs) - min(runs)) / middle if middle > 0 else 0.0


def warn_if_noisy(totals: list[list[float]], stream: TextIO | None = None) -> float:
    """Warn (on stderr) when the noisiest stage's timed runs spread more than NOISE_LIMIT;
    `totals[k]`: stage k's seconds per run. Returns that spread."""
    spreads = [spread(runs) for runs in totals]
    worst = max(spreads, default=0.0)
    if worst <= NOISE_LIMIT:
        return worst
    k = spreads.index(worst)
    runs = totals[k]
    print(
        f"pipec: warning: the profile is too noisy to trust: stage {k}'s {len(runs)} timed runs "
        f"spread {worst:.0%} of their median ({min(runs) * 1e3:.4g} to "
        f"{max(runs) * 1e3:.4g} ms; above {NOISE_LIMIT:.0%} other work shared the device); "
        "profile again when the machine is quiet",
        file=stream or sys.stderr,
        flush=True,
    )
    return worst


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
