"""`launch.py --check-grads`: one pipelined step's gradients against the plain model's.

Every rank runs the step with `GradCapture` in place of the optimizer (it keeps the gradients
the step would apply: after the replica, data-parallel and tied-parameter sums), computes the
reference itself, `loss.backward()` of the unsplit model over the same micro-batches with the
same 1/n weights, and compares each of its stages' parameters with `torch.testing.assert_close`
(the dtype's default tolerances). The reference holds the whole model on each rank's device.

Dropout is off in both (`DropoutOff`): the pipeline draws its masks stage by stage on each rank,
in schedule order, a plain model in one stream, so their masks (and gradients) differ by design.
BatchNorm needs nothing: both compute the statistics of each micro-batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from pipec import checkpoint
from pipec.frontend import load_factory
from pipec.ir import Op
from pipec.runtime.data import MicroBatch, open_source
from pipec.runtime.faults import Watchdog
from pipec.runtime.gather import all_gather_objects
from pipec.runtime.loop import train

if TYPE_CHECKING:
    from pipec.runtime.interpreter import Handler
    from pipec.runtime.preflight import Run
    from pipec.runtime.rank import Rank

aten = torch.ops.aten
F = torch.nn.functional
#: Functions taking a dropout probability, and where: (position in args, keyword).
_DROPOUTS: dict[Callable[..., Any], tuple[int, str]] = {
    **dict.fromkeys(
        (
            F.dropout,
            F.dropout1d,
            F.dropout2d,
            F.dropout3d,
            F.alpha_dropout,
            F.feature_alpha_dropout,
            torch.dropout,
            torch.feature_dropout,
            torch.alpha_dropout,
            torch.feature_alpha_dropout,
            aten.dropout.default,
            aten.native_dropout.default,
            aten.feature_dropout.default,
            aten.alpha_dropout.default,
            aten.feature_alpha_dropout.default,
        ),
        (1, "p"),
    ),
    F.scaled_dot_product_attention: (4, "dropout_p"),
    aten.scaled_dot_product_attention.default: (4, "dropout_p"),
}


class DropoutOff(TorchFunctionMode):
    """While active, every dropout (module, functional, ATen op of a captured graph, SDPA's
    `dropout_p`) runs with probability 0, which is the identity; `dropped` counts the calls
    that asked for more."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        where = _DROPOUTS.get(func)
        if where is not None:
            index, name = where
            if name in kwargs:
                p, kwargs[name] = kwargs[name], 0.0
            elif len(args) > index:
                p, args = args[index], (*args[:index], 0.0, *args[index + 1 :])
            else:
                p = 0.5 if name == "p" else 0.0  # the defaults: F.dropout's p, SDPA's none
                kwargs[name] = 0.0
            self.dropped += bool(p)
        return func(*args, **kwargs)


class GradCapture:
    """Stands in for the optimizer: keeps a copy of every gradient instead of stepping."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.grads: dict[int, Tensor] = {}

    def step(self) -> None:
        self.grads = {id(p): p.grad.detach().clone() for p in self.params if p.grad is not None}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def reference_grads(
    model: nn.Module, loss_fn, batches: list[MicroBatch], device: torch.device
) -> dict[str, Tensor]:  # type: ignore[no-untyped-def]
    """Gradients of `model` (moved to `device`) for the mean loss over `batches`, by name."""
    model.to(device)
    for inputs, target in batches:
        loss = loss_fn(model(*(x.to(device) for x in inputs)), target.to(device))
        (loss / len(batches)).backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


@dataclass(frozen=True)
class StageCheck:
    """One stage's comparison: the largest absolute difference and the first mismatch."""

    stage: int
    rank: int
    names: tuple[str, ...]
    max_abs_diff: float
    error: str | None

    def line(self) -> str:
        verdict = "ok" if self.error is None else f"MISMATCH {self.error}"
        return (
            f"stage {self.stage:>2} (rank {self.rank}): {len(self.names)} tensors, "
            f"max |diff| {self.max_abs_diff:.3g}  {verdict}"
        )


def compare(
    modules: dict[int, nn.Module], rank: int, grads: dict[int, Tensor], ref: dict[str, Tensor]
) -> list[StageCheck]:
    """Each stage's captured gradients (`grads`, by parameter id) against `ref` (by name)."""
    checks = []
    for stage, module in sorted(modules.items()):
        worst, error, names = 0.0, None, []
        for name, p in module.named_parameters(remove_duplicate=False):
            got = grads.get(id(p), torch.zeros_like(p))
            want = ref[name] if ref[name] is not None else torch.zeros_like(p)
            worst = max(worst, (got - want.to(got.device)).abs().max().item())
            names.append(name)
            try:
                torch.testing.assert_close(got, want.to(got.device))
            except AssertionError as e:  # keep its counts: mismatched elements, worst difference
                said = [line for line in str(e).splitlines() if line.startswith(("Mis", "Great"))]
                error = error or f"{name}: {'; '.join(said[:2])}"
        checks.append(StageCheck(stage, rank, tuple(names), worst, error))
    return checks


def check_grads(
    rt: Rank, run: Run, handlers: Mapping[Op, Handler], watchdog: Watchdog, seed: int
) -> bool:
    """One step, then every stage's gradients against the plain model's on the same batch, both
    with dropout off (`DropoutOff`); rank 0 prints one line per stage. True when a stage
    differs (on every rank)."""
    with DropoutOff():
        train(rt, run.start + 1, handlers, watchdog, start=run.start)
    model_plan = rt.build.plan["model"]
    plain = load_factory(run.spec, model_plan["seed"], model_plan.get("micro_batch_size"))
    if run.resume:
        checkpoint.load(run.resume, [plain.model])
    batches = open_source(plain, rt.layout.m * rt.dp, seed, run.start).next()
    with DropoutOff() as off:
        ref = reference_grads(plain.model, plain.loss_fn, batches, rt.device)
    checks = compare(rt.modules, rt.grank, rt.optimizer.grads, ref)
    everyone = all_gather_objects(checks, rt.device)
    found = sorted((c for cs in everyone for c in cs), key=lambda c: (c.stage, c.rank))
    bad = sorted({c.stage for c in found if c.error})
    if rt.grank == 0:
        print(
            f"check-grads: step {run.start + 1}, {len(batches)} micro-batches, against "
            "loss.backward() of the unsplit model (torch.testing.assert_close tolerances)",
            flush=True,
        )
        if off.dropped:
            print(
                f"check-grads: dropout off in both ({off.dropped} dropout calls with p > 0 "
                "ran with p = 0): the pipeline draws masks per stage and rank, not as one "
                "process does",
                flush=True,
            )
        print("\n".join(c.line() for c in found), flush=True)
        if bad:
            print(
                "pipec runtime: check-grads failed: "
                + (f"stage {bad[0]} differs" if len(bad) == 1 else f"stages {_join(bad)} differ")
                + " from the plain model's gradients",
                file=sys.stderr,
                flush=True,
            )
        else:
            print("check-grads: ok, every stage matches", flush=True)
    return bool(bad)


def _join(items: list[int]) -> str:
    return ", ".join(map(str, items))
