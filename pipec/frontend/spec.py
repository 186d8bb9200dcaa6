"""The factory contract: how a user hands pipec a model.

A *factory* is a module-level function taking no arguments and returning a `ModelSpec`: the
model, ONE micro-batch of example inputs, its target, and the loss applied on the last stage to
`(output, target)`. `load_factory("path/to/file.py:name")` or `load_factory("pkg.mod:name")`
seeds torch and calls it, so every process that loads the same spec gets the same weights.
A factory MAY take the micro-batch size as an optional keyword, `factory(micro_batch_size=B)`:
then a build, a plan or a run can ask it for micro-batches of B samples (dim 0 of the example
inputs); a factory without it gives its own size only.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

DEFAULT_SEED = 0
MICRO_BATCH_SIZE = "micro_batch_size"
"""The optional keyword through which a factory takes the micro-batch size."""
CAPTURES = ("auto", "export", "fx")


class FrontendError(ValueError):
    """A problem with the user's model or factory, with a one-line message saying the fix."""


@dataclass(frozen=True)
class ModelSpec:
    """What a factory returns.

    model: the whole model; its forward takes `*example_inputs`.
    example_inputs: one micro-batch, positional, in forward's order.
    example_target: the target of that micro-batch, passed to `loss_fn` on the last stage.
    loss_fn: `(output, target) -> scalar loss`, where output is what the model's forward
        returns, as it returns it (a tensor, a tuple, a dict, a `ModelOutput`).
    concrete_args: forward arguments fixed while capturing (keyword arguments of the capture),
        for Python control flow on flags such as `if use_cache:`.
    leaf_modules: module types torch.fx records as one opaque call instead of tracing into
        (the fx capture only; torch.export always traces through).
    capture: "auto" (torch.export, or torch.fx when export fails), "export" or "fx".
    split_points: qualified names of the blocks where stages 1, 2, … begin (e.g.
        ("layers.4", "layers.8")), instead of an automatic partition.
    data: the training data, or None for synthetic micro-batches shaped like the example. Either
        a callable `data(rows, start)` returning an iterator of `(inputs, target)` global
        batches of `rows` rows from batch `start` on (0 on a fresh run, the checkpoint's step
        on resume), or an iterable of such batches (re-iterated when it runs out; skipped to
        `start` on resume). `inputs` is a tensor or a tuple in forward's order; every tensor has
        the example's shape but `rows` = m·D·(example rows) in its first dimension. The runtime
        cuts each batch into the plan's micro-batches.
    eval_data: the evaluation data (`launch.py --eval-every K`), in `data`'s form; every
        evaluation reads its first `--eval-steps` batches from batch 0.
    """

    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    example_target: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]
    concrete_args: dict[str, Any] | None = None
    leaf_modules: tuple[type[nn.Module], ...] = field(default=())
    data: Callable[[int, int], Iterable[Any]] | Iterable[Any] | None = None
    capture: str = "auto"
    split_points: tuple[str, ...] | None = None
    eval_data: Callable[[int, int], Iterable[Any]] | Iterable[Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise FrontendError(
                f"ModelSpec.model must be an nn.Module, got {type(self.model).__name__}"
            )
        inputs = self.example_inputs
        if (
            not isinstance(inputs, tuple)
            or not inputs
            or not all(isinstance(x, Tensor) for x in inputs)
        ):
            raise FrontendError(
                "ModelSpec.example_inputs must be a non-empty tuple of tensors (one micro-batch),"
                f" got {type(inputs).__name__}; wrap a single tensor as (x,)"
            )
        if not isinstance(self.example_target, Tensor):
            raise FrontendError(
                "ModelSpec.example_target must be a tensor, "
                f"got {type(self.example_target).__name__}"
            )
        if not callable(self.loss_fn):
            raise FrontendError("ModelSpec.loss_fn must be callable: (output, target) -> loss")
        for name in ("data", "eval_data"):
            data = getattr(self, name)
            if data is not None and not (callable(data) or isinstance(data, Iterable)):
                raise FrontendError(
                    f"ModelSpec.{name} must be a callable {name}(rows, start) or an iterable of "
                    f"(inputs, target) batches, got {type(data).__name__}"
                )
        if self.capture not in CAPTURES:
            raise FrontendError(
                f"ModelSpec.capture={self.capture!r}; use one of {', '.join(CAPTURES)}"
            )
        points = self.split_points
        if points is not None and (
            not isinstance(points, tuple) or not all(isinstance(p, str) for p in points)
        ):
            raise FrontendError(
                "ModelSpec.split_points must be a tuple of module names such as "
                f"('layers.4', 'layers.8'), got {points!r}"
            )


def next_token_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of `logits` (batch, seq, vocab) against `target` (batch, seq), averaged
    over the micro-batch's tokens. Position t is scored against target[:, t] as given: the
    target must already be shifted (target[:, t] is the token after input t, i.e. the inputs
    moved left by one); nothing is shifted here."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def token_model_spec(
    build: Callable[[], nn.Module], vocab: int, micro_batch: int, seq_len: int, device: str = "cpu"
) -> ModelSpec:
    """A language model's ModelSpec: the model `build` makes (on `device`) and one random
    micro-batch of token ids and next-token targets, scored with `next_token_loss`."""
    with torch.device(device):
        model = build()
        tokens = torch.randint(vocab, (micro_batch, seq_len))
        target = torch.randint(vocab, (micro_batch, seq_len))
    return ModelSpec(model, (tokens,), target, next_token_loss)


def load_factory(
    spec: str, seed: int = DEFAULT_SEED, micro_batch_size: int | None = None
) -> ModelSpec:
    """Import the factory named by `spec`, seed torch with `seed`, call it, check the result.

    `spec` is `path/to/file.py:factory` or `package.module:factory`. `micro_batch_size`, if
    given, is passed to a factory that takes it (`takes_micro_batch_size`); either way the
    result must give micro-batches of that many samples. Raises `FrontendError` (one line
    naming the input and the fix) for a malformed spec, a missing file or module, a missing or
    non-callable factory, a factory that raises, one that returns something other than a
    `ModelSpec`, or one that cannot give the micro-batch size asked for.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise FrontendError(
            f"model spec {spec!r} must look like path/to/file.py:factory or package.module:factory"
        )
    module = _import(spec, where)
    factory = getattr(module, name, None)
    if factory is None:
        available = ", ".join(_factories(module)) or "none"
        raise FrontendError(
            f"model spec {spec!r}: {where} has no factory {name!r} (available: {available})"
        )
    if not callable(factory):
        raise FrontendError(
            f"model spec {spec!r}: {name!r} is a {type(factory).__name__}, "
            "not a function returning a ModelSpec"
        )
    sized = micro_batch_size is not None and _takes_size(factory)
    torch.manual_seed(seed)
    try:
        result = factory(**{MICRO_BATCH_SIZE: micro_batch_size}) if sized else factory()
    except FrontendError:
        raise
    except (Exception, SystemExit) as e:
        raise FrontendError(
            f"model spec {spec!r}: the factory raised {type(e).__name__}: {e}"
        ) from e
    if not isinstance(result, ModelSpec):
        raise FrontendError(
            f"model spec {spec!r} returned {type(result).__name__}; a factory must return "
            "pipec.frontend.ModelSpec(model, example_inputs, example_target, loss_fn)"
        )
    if micro_batch_size is not None:
        _check_size(spec, result, micro_batch_size, sized)
    return result


def takes_micro_batch_size(spec: str) -> bool:
    """Whether the factory `spec` names takes the `micro_batch_size` keyword (False for a spec
    that names no factory: `load_factory` says why)."""
    where, _, name = spec.rpartition(":")
    return _takes_size(getattr(_import(spec, where), name, None))


def _takes_size(factory: object) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == MICRO_BATCH_SIZE and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )


def _check_size(spec: str, result: ModelSpec, wanted: int, sized: bool) -> None:
    """Refuse a factory whose micro-batches (dim 0 of its first example input) are not
    `wanted` samples, with the fix: the keyword it lacks, or the keyword it ignores."""
    first = result.example_inputs[0]
    got = first.shape[0] if first.dim() else None
    if got == wanted:
        return
    name = spec.rpartition(":")[2]
    if sized:
        raise FrontendError(
            f"model spec {spec!r} was asked for {MICRO_BATCH_SIZE}={wanted} but gives "
            f"micro-batches of {got} samples (dim 0 of its first example input); size the "
            f"example by the keyword"
        )
    raise FrontendError(
        f"model spec {spec!r} gives micro-batches of {got} samples and takes no "
        f"{MICRO_BATCH_SIZE} keyword; micro-batches of {wanted} are needed: give {name} a "
        f"`{MICRO_BATCH_SIZE}: int = {got}` parameter that sizes its example inputs"
    )


def _import(spec: str, where: str) -> ModuleType:
    """The module a spec names: a file when `where` ends in .py or has a slash, else a module."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise FrontendError(
                f"model spec {spec!r}: no file {where} (looked in {Path.cwd()}); "
                "pass path/to/file.py:factory or package.module:factory"
            )
        # One module per file: loading the same file twice reuses it (and its fx.wrap calls).
        mod_name = "_pipec_factory_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
        try:
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # a factory's sys.exit is its error too
            del sys.modules[mod_name]
            raise FrontendError(
                f"model spec {spec!r}: importing {where} raised {type(e).__name__}: {e}"
            ) from e
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is not None and (where == e.name or where.startswith(e.name + ".")):
            raise FrontendError(
                f"model spec {spec!r}: no module {where} ({e}); put it on PYTHONPATH "
                "or pass path/to/file.py:factory"
            ) from e
        raise FrontendError(
            f"model spec {spec!r}: importing {where} raised ModuleNotFoundError: {e}"
        ) from e
    except (Exception, SystemExit) as e:
        raise FrontendError(
            f"model spec {spec!r}: importing {where} raised {type(e).__name__}: {e}"
        ) from e


def _factories(module: ModuleType) -> list[str]:
    """Functions defined in `module` callable without arguments: the likely factories."""
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(obj):
            continue
        if obj.__module__ != module.__name__:
            continue
        params = inspect.signature(obj).parameters.values()
        if all(
            p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params
        ):
            names.append(name)
    return sorted(names)
