"""Checkpoints: safetensors files keyed by the model's own names, a JSON manifest, no pickle.

    DIR/step_000006/                  a complete checkpoint
        rank_00000.safetensors        the tensors rank 0 owned, under their names
        rank_00001.safetensors        ...one file per rank that had something to write
        manifest.json                 written last (pipec/checkpoint_manifest.py): step, every
                                      file's sha256 and size, which file holds each tensor
                                      (shape, dtype), aliases, the JSON scalars, the run
    DIR/step_000003/                  the one before it (a run keeps its two newest)
    DIR/.step_000009.partial/         a save under way, or one killed mid-write: never read

Keys: `model.NAME` for every entry of the model's state_dict (`model.blocks.3.attn.qkv.weight`),
`optim.NAME.STATE` for the optimizer state of parameter NAME (AdamW: step, exp_avg,
exp_avg_sq), and `step`, the number of training steps done. Pipeline stages keep the model's
names and a load reads each name from whichever file holds it, so a checkpoint saved by one
build loads into any other partition, schedule or rank count of the same model, and into the
plain model in one process (`load_full`). Each tensor is written once: a tied parameter's
other names (an LM head tied to the embedding) are `Alias`es of its first, listed in the
manifest's `aliases`; a tensor several ranks hold under one name (a buffer every stage reads)
is written by the first of them.

Nothing read back is unpickled: safetensors holds only tensors and JSON, the manifest is JSON.
A load first checks every file against the manifest (`verify`, in pipec/checkpoint_files.py)
and the manifest against the model (`check_fits`, pipec/checkpoint_contents.py), and names the
first defect; `newest_intact` skips a damaged newest checkpoint for the one before it.

Atomic: every rank writes into the .partial directory and describes its file in a small
JSON beside it; after a barrier rank 0 folds those into manifest.json (written to a temporary
name, fsynced, renamed) and renames the directory to step_N (one rename). A run killed at any
point leaves every step_N directory complete.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pipec.checkpoint_contents import check_fits
from pipec.checkpoint_files import (
    checkpoints,
    describe,
    manifest,
    newest_intact,
    step_dir,
    verify,
)
from pipec.checkpoint_lineage import Lineage, prune, sync
from pipec.checkpoint_manifest import DTYPES, FORMAT, MANIFEST
from pipec.ir import PipecError

__all__ = [  # the files' helpers are part of what this module offers
    "Alias", "check_fits", "checkpoints", "export_model", "keys_of", "latest", "load",
    "load_full", "manifest", "newest_intact", "read", "save", "saved_step", "state_dict",
    "step_dir", "verify",
]  # fmt: skip
KEEP = 2  # a run's newest checkpoints kept; its older ones are removed after each save
_CODES = {getattr(torch, name): code for code, name in DTYPES.items()}  # safetensors' dtype names


@dataclass(frozen=True)
class Alias:
    """A key whose tensor is key `of`'s (a tied parameter's other name): written once, as `of`."""

    of: str


def state_dict(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict:
    """What `save` writes for `modules`: their state_dicts and their parameters' optimizer
    state, under the model's names (a tensor with two names: an `Alias` under the second)."""
    state: dict[str, object] = {}
    first: dict[int, str] = {}  # a tensor's first name
    for module in modules:
        for name, t in module.state_dict(keep_vars=True).items():
            known = first.setdefault(id(t), name)
            state[f"model.{name}"] = t.detach() if known == name else Alias(f"model.{known}")
        if optimizer is not None:
            for name, p in module.named_parameters(remove_duplicate=False):
                known = first.setdefault(id(p), name)
                for key, value in optimizer.state.get(p, {}).items():
                    own = known == name
                    state[f"optim.{name}.{key}"] = value if own else Alias(f"optim.{known}.{key}")
    return state


# -- saving ---------------------------------------------------------------------------------------


def save(
    directory: Path,
    step: int,
    state: dict,
    lineage: Lineage | None = None,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write `state` (this rank's part, see `state_dict`) as DIR/step_N; every rank calls it.

    Each rank writes its tensors to its own file; rank 0 then writes the manifest (recording
    `lineage`, the run), publishes the checkpoint with one rename and removes the run's own
    checkpoints but its `KEEP` newest. The ranks meet in barriers of `group` (the default
    group if None; runtime/saving.py writes in a thread, in a group of its own). Returns its
    path.
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
        dist.barrier(group)  # nobody writes into the partial directory before it exists
    _write_part(partial, rank, state)
    if distributed:
        dist.barrier(group)  # every rank's file and its description are on disk
    if rank == 0:
        _write_manifest(partial, step, lineage)
        if final.exists():  # a step saved again (a resumed run re-saving it): replace it
            old = directory / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)
        sync(directory)
        if lineage is not None:
            prune(directory, lineage, KEEP)
    return final


def _write_part(partial: Path, rank: int, state: dict) -> None:
    """This rank's tensors as rank_R.safetensors, and rank_R.json: its file's sha256 and size,
    each tensor's shape and dtype, the aliases and the values that are not tensors (JSON
    scalars)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    aliases: dict[str, str] = {}
    for key, value in state.items():
        if isinstance(value, Alias):
            aliases[key] = value.of
        elif isinstance(value, torch.Tensor):
            tensors[key] = value.detach().cpu()
        elif value is None or isinstance(value, (bool, int, float, str)):
            scalars[key] = value
        else:
            raise PipecError(
                f"checkpoint: {key} is a {type(value).__name__}, not a tensor or scalar"
            )
    name = f"rank_{rank:05d}.safetensors"
    part: dict = {"scalars": scalars, "aliases": aliases, "files": {}, "tensors": {}}
    if tensors:
        _write_safetensors(partial / name, tensors)
        part["files"][name] = describe(partial / name)
        part["tensors"] = {
            k: {"file": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for k, t in tensors.items()
        }
    _write_json(partial / f"rank_{rank:05d}.json", part)


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` (on the CPU) as a safetensors file: the length of its header (8 bytes,
    little-endian), the header (JSON: each tensor's dtype, shape and byte range), the tensors'
    bytes end to end. safetensors' own `save_file` takes each tensor through numpy in Python
    (80 ms for 400 small tensors, holding the interpreter, which a background save shares
    with training: runtime/saving.py); here one `torch.cat` gathers the bytes and one write
    stores them."""
    if sys.byteorder != "little":  # the format's byte order, which the bytes are written in
        raise PipecError("checkpoints are written on little-endian machines only")
    header: dict[str, dict] = {}
    parts, at = [], 0
    for key, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        header[key] = {"dtype": _CODES[t.dtype], "shape": list(t.shape)}
        header[key]["data_offsets"] = [at, at + raw.numel()]
        parts.append(raw)
        at += raw.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as safetensors aligns it
    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        if at:
            f.write((ctypes.c_ubyte * at).from_address(data.data_ptr()))


def _write_manifest(partial: Path, step: int, lineage: Lineage | None) -> None:
    """Fold the ranks' descriptions into manifest.json (atomically) and remove them. A key
    two ranks wrote, or an alias of a tensor nobody wrote, is a fault of the saving code: the
    save fails rather than publish a manifest that is not what was written."""
    run = lineage.record() if lineage else None
    folded: dict = {"format": FORMAT, "step": step, "run": run, "files": {}, "tensors": {}}
    folded |= {"aliases": {}, "scalars": {}}
    parts = sorted(partial.glob("rank_*.json"))
    for part_file in parts:
        part = json.loads(part_file.read_text())
        for key in ("files", "tensors", "aliases", "scalars"):
            if twice := folded[key].keys() & part[key].keys():
                raise PipecError(f"checkpoint: {min(twice)} written by two ranks")
            folded[key] |= part[key]
    if lost := set(folded["aliases"].values()) - folded["tensors"].keys():
        raise PipecError(f"checkpoint: {min(lost)} aliased but written by no rank")
    folded["scalars"]["step"] = step
    _write_json(partial / MANIFEST, folded)
    for part_file in parts:
        part_file.unlink()


def _write_json(path: Path, value: dict) -> None:
    """Write `value` to `path` whole or not at all: a temporary name, fsync, one rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        # dumps, not dump: dump encodes in Python (a manifest of 400 tensors: 40 ms, holding
        # the interpreter a background save shares with training), dumps in C.
        f.write(json.dumps(value, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


# -- reading --------------------------------------------------------------------------------------


def latest(path: Path) -> Path:
    """`path` itself if it is one checkpoint, else the newest intact checkpoint in it."""
    return newest_intact(path)[0]


def saved_step(path: Path) -> int:
    """The number of training steps checkpoint `path` had done."""
    return int(manifest(path)["step"])


def read(path: Path, keys: Iterable[str], saved: dict) -> dict[str, object]:
    """The values of `keys` in checkpoint `path` (manifest `saved`), each tensor read from the
    file that holds it (on the CPU; an alias's is its tensor's) and each scalar from the
    manifest."""
    aliases = saved.get("aliases", {})
    keys = list(keys)
    by_file: dict[str, set[str]] = {}
    out: dict[str, object] = {}
    for key in {aliases.get(k, k) for k in keys}:
        if key in saved["tensors"]:
            by_file.setdefault(saved["tensors"][key]["file"], set()).add(key)
        else:
            out[key] = saved["scalars"][key]
    for name, wanted in by_file.items():
        with safe_open(str(Path(path) / name), framework="pt") as f:
            out |= {key: f.get_tensor(key) for key in wanted}
    return {key: out[aliases.get(key, key)] for key in keys}


def load(
    path: Path,
    modules: Iterable[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    check: bool = True,
) -> int:
    """Load checkpoint `path` into `modules` (in place) and, if given, `optimizer` (the state
    of the modules' parameters; hyperparameters stay the optimizer's). Returns the step.

    Reads only (no collective): each rank of a pipelined run loads its own stages. `check`
    verifies the files and checks the contents against the modules first (off only where the
    caller has just done so).
    """
    path = Path(path)
    modules = list(modules)
    saved = verify(path) if check else manifest(path)
    for module in modules:
        if check:
            check_fits(path, module, saved, whole=False)
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
    every = keys_of(saved)
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
    check_fits(path, model)
    return load(path, [model], optimizer, check=False)  # both checked here


def export_model(path: Path, out: Path, notice: Callable[[str], None] | None = None) -> Path:
    """Write the model part of checkpoint `path` (newest intact, if a directory of them) as
    one `model.safetensors` in directory `out`, under the model's own names: beside the
    model's config.json, what `transformers`' `from_pretrained(out)` loads."""
    path, skipped = newest_intact(path)
    for line in skipped:
        if notice:
            notice(line)
    saved = manifest(path)
    keys = sorted(k for k in keys_of(saved) if k.startswith("model."))
    values = read(path, keys, saved)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    aliases = saved.get("aliases", {})
    # safetensors refuses two names on one tensor: a tied name gets its own copy
    tensors = {k.removeprefix("model."): values[k] for k in keys}
    tensors |= {k.removeprefix("model."): values[k].clone() for k in keys if k in aliases}
    save_file(tensors, str(target), {"format": "pt"})
    return target


def keys_of(saved: dict) -> set[str]:
    """Every key of a checkpoint (manifest `saved`): tensors, aliases and scalars."""
    return saved["tensors"].keys() | saved.get("aliases", {}).keys() | saved["scalars"].keys()
