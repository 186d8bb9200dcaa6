"""Checkpoints: safetensors files keyed by the model's own names, a JSON manifest, no pickle.

    DIR/step_000006/                  a complete checkpoint
        rank_00000.safetensors        the tensors rank 0 owned, under their names
        rank_00001.safetensors        ...one file per rank that had something to write
        manifest.json                 written last: step, every file's sha256 and size, which
                                      file holds each tensor (shape, dtype), the JSON scalars
    DIR/step_000003/                  the one before it (the two newest are kept)
    DIR/.step_000009.partial/         a save under way, or one killed mid-write: never read

Keys: `model.NAME` for every entry of the model's state_dict (`model.blocks.3.attn.qkv.weight`),
`optim.NAME.STATE` for the optimizer state of parameter NAME (AdamW: step, exp_avg,
exp_avg_sq), and `step`, the number of training steps done. Pipeline stages keep the model's
names and a load reads each name from whichever file holds it, so a checkpoint saved by one
build loads into any other partition, schedule or rank count of the same model, and into the
plain model in one process (`load_full`).

Nothing read back is unpickled: safetensors holds only tensors and JSON, the manifest is JSON.
A load first checks every file against the manifest's sha256 (`verify`, in
pipec/checkpoint_files.py) and names the first bad one; `newest_intact` skips a damaged newest
checkpoint for the one before it.

Atomic: every rank writes into the .partial directory and describes its file in a small
JSON beside it; after a barrier rank 0 folds those into manifest.json (written to a temporary
name, fsynced, renamed) and renames the directory to step_N (one rename). A run killed at any
point leaves every step_N directory complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pipec.checkpoint_files import (
    FORMAT,
    MANIFEST,
    checkpoints,
    describe,
    manifest,
    newest_intact,
    step_dir,
    verify,
)
from pipec.ir import PipecError

KEEP = 2  # newest checkpoints kept; older ones are removed after each save


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


# -- saving ---------------------------------------------------------------------------------------


def save(directory: Path, step: int, state: dict) -> Path:
    """Write `state` (this rank's part, see `state_dict`) as DIR/step_N; every rank calls it.

    Each rank writes its tensors to its own file; rank 0 then writes the manifest, publishes
    the checkpoint with one rename and removes all but the `KEEP` newest. Returns its path.
    """
    directory = Path(directory)
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    final = step_dir(directory, step)
    partial = directory / f".{final.name}.partial"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".step_*.partial"):  # left by killed saves
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    if distributed:
        dist.barrier()  # nobody writes into the partial directory before it exists
    _write_part(partial, rank, state)
    if distributed:
        dist.barrier()  # every rank's file and its description are on disk
    if rank == 0:
        _write_manifest(partial, step)
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


def _write_part(partial: Path, rank: int, state: dict) -> None:
    """This rank's tensors as rank_R.safetensors, and rank_R.json: its file's sha256 and size,
    each tensor's shape and dtype, and the values that are not tensors (JSON scalars)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    storages: set[int] = set()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            # safetensors refuses two names on one storage (tied weights): give each its own.
            ptr = t.untyped_storage().data_ptr()
            tensors[key] = t.clone() if ptr in storages else t
            storages.add(ptr)
        elif value is None or isinstance(value, (bool, int, float, str)):
            scalars[key] = value
        else:
            raise PipecError(
                f"checkpoint: {key} is a {type(value).__name__}, not a tensor or scalar"
            )
    name = f"rank_{rank:05d}.safetensors"
    part: dict = {"scalars": scalars, "files": {}, "tensors": {}}
    if tensors:
        save_file(tensors, str(partial / name))
        part["files"][name] = describe(partial / name)
        part["tensors"] = {
            k: {"file": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for k, t in tensors.items()
        }
    _write_json(partial / f"rank_{rank:05d}.json", part)


def _write_manifest(partial: Path, step: int) -> None:
    """Fold the ranks' descriptions into manifest.json (atomically) and remove them."""
    folded: dict = {"format": FORMAT, "step": step, "files": {}, "tensors": {}, "scalars": {}}
    parts = sorted(partial.glob("rank_*.json"))
    for part_file in parts:
        part = json.loads(part_file.read_text())
        for key in ("files", "tensors", "scalars"):
            folded[key] |= part[key]
    folded["scalars"]["step"] = step
    _write_json(partial / MANIFEST, folded)
    for part_file in parts:
        part_file.unlink()


def _write_json(path: Path, value: dict) -> None:
    """Write `value` to `path` whole or not at all: a temporary name, fsync, one rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _sync(directory: Path) -> None:
    """Make the rename durable (a power cut after it must not bring the old name back)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------------------------


def latest(path: Path) -> Path:
    """`path` itself if it is one checkpoint, else the newest intact checkpoint in it."""
    return newest_intact(path)[0]


def saved_step(path: Path) -> int:
    """The number of training steps checkpoint `path` had done."""
    return int(manifest(path)["step"])


def check_fits(path: Path, model: nn.Module, saved: dict | None = None) -> None:
    """Raise PipecError unless checkpoint `path` (whose manifest `saved` is, when already read)
    holds every entry of `model`'s state_dict with its shape: a checkpoint of another model is
    refused before anything is loaded."""
    tensors = (saved or manifest(path))["tensors"]
    for name, t in model.state_dict().items():
        entry = tensors.get(f"model.{name}")
        if entry is None:
            raise PipecError(f"{path}: no {name} in this checkpoint; was it saved from this model?")
        if tuple(entry["shape"]) != tuple(t.shape):
            raise PipecError(
                f"{path}: {name} is {tuple(entry['shape'])} in this checkpoint, {tuple(t.shape)} "
                "in the model; was it saved from this model?"
            )


def read(path: Path, keys: Iterable[str], saved: dict) -> dict[str, object]:
    """The values of `keys` in checkpoint `path` (manifest `saved`), each tensor read from the
    file that holds it (on the CPU) and each scalar from the manifest."""
    by_file: dict[str, list[str]] = {}
    out: dict[str, object] = {}
    for key in keys:
        if key in saved["tensors"]:
            by_file.setdefault(saved["tensors"][key]["file"], []).append(key)
        else:
            out[key] = saved["scalars"][key]
    for name, wanted in by_file.items():
        with safe_open(str(Path(path) / name), framework="pt") as f:
            out |= {key: f.get_tensor(key) for key in wanted}
    return out


def load(
    path: Path,
    modules: Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    check: bool = True,
) -> int:
    """Load checkpoint `path` into `modules` (in place) and, if given, `optimizer` (the state
    of the modules' parameters; hyperparameters stay the optimizer's). Returns the step.

    Reads only (no collective): each rank of a pipelined run loads its own stages. `check`
    verifies the files first (off only where the caller has just verified them).
    """
    path = Path(path)
    modules = list(modules)
    saved = verify(path) if check else manifest(path)
    for module in modules:
        check_fits(path, module, saved)
        keys = [f"model.{name}" for name in module.state_dict()]
        values = read(path, keys, saved)
        module.load_state_dict({k.removeprefix("model."): values[k] for k in keys})
    if optimizer is not None:
        _load_optimizer(path, saved, modules, optimizer)
    return int(saved["step"])


def _load_optimizer(
    path: Path, saved: dict, modules: list[nn.Module], optimizer: torch.optim.Optimizer
) -> None:
    """The saved state of each optimized parameter of `modules`, found by its name."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    every = saved["tensors"].keys() | saved["scalars"].keys()
    loaded: dict[int, dict[str, object]] = {}
    for module in modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) not in index or index[id(p)] in loaded:
                continue
            prefix = f"optim.{name}."
            keys = [k for k in every if k.startswith(prefix) and "." not in k[len(prefix) :]]
            if keys:
                values = read(path, keys, saved)
                loaded[index[id(p)]] = {k[len(prefix) :]: v for k, v in values.items()}
    optimizer.load_state_dict(
        {"state": loaded, "param_groups": optimizer.state_dict()["param_groups"]}
    )


def load_full(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Load the newest intact checkpoint in `directory` (or the checkpoint `directory`) into
    the plain, unpartitioned `model` in one process, and its optimizer state into `optimizer`
    if given. Returns the number of steps the checkpoint had trained."""
    path = latest(directory)
    return load(path, [model], optimizer, check=False)  # latest verified it


def export_model(path: Path, out: Path, notice: Callable[[str], None] | None = None) -> Path:
    """Write the model part of checkpoint `path` (newest intact, if a directory of them) as
    one `model.safetensors` in directory `out`, under the model's own names: beside the
    model's config.json, what `transformers`' `from_pretrained(out)` loads."""
    path, skipped = newest_intact(path)
    for line in skipped:
        if notice:
            notice(line)
    saved = manifest(path)
    keys = sorted(k for k in saved["tensors"] if k.startswith("model."))
    values = read(path, keys, saved)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    save_file({k.removeprefix("model."): values[k] for k in keys}, str(target), {"format": "pt"})
    return target
