"""A checkpoint's contents against the model it is loaded into, before anything is loaded.

Loading casts and slices (`Tensor.copy_`, a ZeRO shard's slice of a flat state), so a tensor of
another dtype or size would be trained on silently, or fail only at the first optimizer step.
`check_fits` refuses, naming the key, any difference between the manifest (whose agreement
with the files' headers pipec/checkpoint_files.py's `verify` checks) and the model:

- `model.NAME`: every entry of the model's state_dict, nothing else, each of the model's
  shape and dtype (a floating tensor narrower than fp32 may be saved as its fp32 master);
- `optim.NAME.STATE`: NAME a parameter of the model; `step` one number (a scalar, or a tensor
  of shape ()), any other state a tensor of the parameter's shape (a one-number `exp_avg`
  would be broadcast, or overrun by the fused step's kernel), in fp32 or the parameter's dtype;
- nothing else but `step`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipec.checkpoint_files import manifest
from pipec.ir import PipecError


def check_fits(path: Path, model: nn.Module, saved: dict | None = None, whole: bool = True) -> None:
    """Raise PipecError unless checkpoint `path` (whose manifest `saved` is, when already read)
    holds what `model` saves, as the module doc says. `whole`: `model` is the whole model, so
    a key naming nothing in it is refused too (a stage checks only its own)."""
    saved = saved or manifest(path)
    tensors, aliases = saved["tensors"], saved.get("aliases", {})
    ours = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in ours.items():
        key = f"model.{name}"
        entry = tensors.get(aliases.get(key, key))
        if entry is None:
            raise PipecError(f"{path}: no {name} in this checkpoint; was it saved from this model?")
        _fits(path, key, entry, [tuple(t.shape)], _dtypes(t.dtype))
    for key in sorted(tensors.keys() | aliases.keys() | saved["scalars"].keys()):
        head, _, rest = key.partition(".")
        name = rest.rpartition(".")[0]
        if key == "step" or head == "model" and rest in ours:
            continue
        if head != "optim" or name not in params:
            if not whole:
                continue
            raise PipecError(
                f"{path}: {key} is in this checkpoint but not in the model; was it saved from "
                "this model?"
            )
        p, count = params[name], key.endswith(".step")
        if key in saved["scalars"]:
            value = saved["scalars"][key]
            if not count:
                raise PipecError(f"{path}: {key} is {value!r}, not a tensor of {name}'s shape")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PipecError(f"{path}: {key} is {value!r}, not a number")
            continue
        entry = tensors[aliases.get(key, key)]
        _fits(path, key, entry, [() if count else tuple(p.shape)], {"float32", _name(p.dtype)})


def _dtypes(dtype: torch.dtype) -> set[str]:
    """The dtypes a checkpoint may hold a model's tensor of `dtype` in: its own, and fp32 for a
    narrower floating one (the run's fp32 master)."""
    if dtype.is_floating_point and dtype.itemsize < 4:
        return {_name(dtype), "float32"}
    return {_name(dtype)}


def _fits(path: Path, key: str, entry: dict, shapes: list[tuple], dtypes: set[str]) -> None:
    shape = tuple(entry["shape"])
    if shape not in shapes or entry["dtype"] not in dtypes:
        raise PipecError(
            f"{path}: {key} is {entry['dtype']} {shape} in this checkpoint, "
            f"{' or '.join(sorted(dtypes))} {' or '.join(map(str, shapes))} in the model; was it "
            "saved from this model?"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
