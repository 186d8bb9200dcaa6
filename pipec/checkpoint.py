"""Checkpoints: torch.distributed.checkpoint (DCP) directories keyed by the model's own names.

    DIR/step_000006/           a complete checkpoint: DCP's .metadata and one file per writer
    DIR/step_000003/           the one before it (the two newest are kept)
    DIR/.step_000009.partial/  a save under way, or one killed mid-write: never read

Keys: `model.NAME` for every entry of the model's state_dict (`model.blocks.3.attn.qkv.weight`),
`optim.NAME.STATE` for the optimizer state of parameter NAME (AdamW: step, exp_avg,
exp_avg_sq), and `step`, the number of training steps done. Pipeline stages keep the model's
names, so a checkpoint saved by one build loads into any other partition, schedule or rank
count of the same model, and into the plain model in one process (`load_full`).

Atomic: every rank writes into the .partial directory; DCP writes its .metadata last, after
every rank's files, and only then does rank 0 rename the directory to step_N (one rename). A
run killed at any point leaves every step_N directory complete, so the newest one loads.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pipec.ir import PipecError

KEEP = 2  # newest checkpoints kept; older ones are removed after each save
_STEP = re.compile(r"^step_(\d{6,})$")


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found) if (p / ".metadata").is_file()]


def latest(path: Path) -> Path:
    """`path` itself if it is one checkpoint, else the newest checkpoint in it."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    found = checkpoints(path)
    if not found:
        raise PipecError(
            f"{path}: no checkpoint here (no complete step_NNNNNN directory); "
            f"save one with launch.py --save {path}"
        )
    return found[-1]


def state_dict(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict:
    """What `save` writes for `modules`: their state_dicts and their parameters' optimizer
    state, under the model's names (a parameter with two names is written under both)."""
    state: dict[str, object] = {}
    for module in modules:
        state |= {f"model.{name}": t for name, t in module.state_dict().items()}
        if optimizer is not None:
            for name, p in module.named_parameters(remove_duplicate=False):
                for key, value in optimizer.state.get(p, {}).items():
                    state[f"optim.{name}.{key}"] = value
    return state


def save(directory: Path, step: int, state: dict) -> Path:
    """Write `state` (this rank's part, see `state_dict`) as DIR/step_N; every rank calls it.

    With a process group, DCP gathers the ranks' plans and writes one file per rank that has
    something to write; rank 0 then publishes the checkpoint with one rename and removes all
    but the `KEEP` newest. Returns the checkpoint's path.
    """
    directory = Path(directory)
    distributed = dist.is_initialized()
    first = not distributed or dist.get_rank() == 0
    final = step_dir(directory, step)
    partial = directory / f".{final.name}.partial"
    if first:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a killed save
    if distributed:
        dist.barrier()  # nobody writes into the partial directory before it is clean
    with _quiet():
        dcp.save(
            state | ({"step": step} if first else {}),
            checkpoint_id=partial,
            no_dist=not distributed,
        )
    if first:
        if final.exists():  # a step saved again (a resumed run re-saving it): replace it
            old = directory / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)
        _sync(directory)
        for stale in checkpoints(directory)[:-KEEP]:
            shutil.rmtree(stale)
    return final


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it 'assumes the intent' of a single-process load: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _sync(directory: Path) -> None:
    """Make the rename durable (a power cut after it must not bring the old name back)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_step(path: Path) -> int:
    """The number of training steps checkpoint `path` had done."""
    state: dict[str, object] = {"step": 0}
    with _quiet():
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return int(state["step"])


def check_fits(path: Path, model: nn.Module, saved: dict | None = None) -> None:
    """Raise PipecError unless checkpoint `path` (whose metadata `saved` is, when already read)
    holds every entry of `model`'s state_dict with its shape: a checkpoint of another model is
    refused before anything is loaded."""
    if saved is None:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, t in model.state_dict().items():
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise PipecError(f"{path}: no {name} in this checkpoint; was it saved from this model?")
        if tuple(entry.size) != tuple(t.shape):
            raise PipecError(
                f"{path}: {name} is {tuple(entry.size)} in this checkpoint, {tuple(t.shape)} in "
                "the model; was it saved from this model?"
            )


def entries(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """What checkpoint `path` holds: each key's shape and dtype (None: not a tensor)."""
    saved = dcp.FileSystemReader(Path(path)).read_metadata().state_dict_metadata
    return {
        k: (tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
        for k, v in saved.items()
    }


def read(path: Path, state: dict) -> None:
    """Fill `state` (key: a tensor of the saved shape and dtype, or a placeholder for other
    values) from checkpoint `path`, in place. Reads only (no collective)."""
    with _quiet():
        dcp.load(state, checkpoint_id=Path(path), no_dist=True)


def load(
    path: Path, modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Load checkpoint `path` into `modules` (in place) and, if given, `optimizer` (the state
    of the modules' parameters; hyperparameters stay the optimizer's). Returns the step.

    Reads only (no collective): each rank of a pipelined run loads its own stages.
    """
    path = Path(path)
    modules = list(modules)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for module in modules:
        check_fits(path, module, saved)
    state = {"step": 0} | state_dict(modules, None)
    moments = _optimizer_templates(saved, modules, optimizer) if optimizer is not None else {}
    for keys in moments.values():
        state |= keys
    with _quiet():
        dcp.load(state, checkpoint_id=path, no_dist=True)
    if optimizer is not None:
        index = {id(p): i for i, p in enumerate(_params(optimizer))}
        loaded = {
            index[pid]: {key.rsplit(".", 1)[1]: state[key] for key in keys}
            for pid, keys in moments.items()
        }
        optimizer.load_state_dict(
            {"state": loaded, "param_groups": optimizer.state_dict()["param_groups"]}
        )
    return int(state["step"])


def _params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_templates(
    saved: dict, modules: list[nn.Module], optimizer: torch.optim.Optimizer
) -> dict[int, dict[str, object]]:
    """Per optimized parameter (by id), the checkpoint's keys of its state, as tensors of the
    saved shape for DCP to fill (other values as placeholders it replaces)."""
    mine = {id(p) for p in _params(optimizer)}
    templates: dict[int, dict[str, object]] = {}
    for module in modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in mine or id(p) in templates:
                continue
            prefix = f"optim.{name}."
            keys = {
                k: v
                for k, v in saved.items()
                if k.startswith(prefix) and "." not in k[len(prefix) :]
            }
            if keys:
                templates[id(p)] = {
                    k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                    if isinstance(v, TensorStorageMetadata)
                    else None
                    for k, v in keys.items()
                }
    return templates


def load_full(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Load the newest checkpoint in `directory` (or the checkpoint `directory`) into the plain,
    unpartitioned `model` in one process, and its optimizer state into `optimizer` if given.
    Returns the number of steps the checkpoint had trained."""
    return load(latest(directory), [model], optimizer)
