"""A checkpoint's manifest.json and its form, read with bounds: a checkpoint may come from anyone.

    {"format": "pipec.checkpoint/2",
     "step": 6,                                   training steps done, also scalars["step"]
     "files": {"rank_00000.safetensors": {"bytes": 81920, "sha256": "9f2c..."}, ...},
     "tensors": {"model.wte.weight": {"file": "rank_00000.safetensors", "shape": [32, 32],
                                      "dtype": "float32"}, ...},
     "aliases": {"model.lm_head.weight": "model.wte.weight", ...},
     "scalars": {"step": 6, ...},                 the values that are not tensors (JSON)
     "run": {"id": "3f2a...", "model": "<fingerprint>", "build": "<plan hash>",
             "resumed_from": "/abs/ckpt/step_000003" or null}}

`aliases` names each tied tensor's other keys (a tied embedding and LM head are written once,
under the first name); `run` is the lineage of the run that saved it (pipec/checkpoint_lineage.py).
Format 1 (pipec before aliases and lineages) has neither and is still read.

`parse` refuses, as a `NotAManifest` saying what is wrong, anything but this form: a file over
`MAX_BYTES`, nesting past what JSON's parser allows, a number that is not finite (`1e999`,
`NaN`), a negative or non-integer count, a step that disagrees with scalars' step, a tensor in a
file it does not list, a dtype pipec does not write, an alias of a key that is not a tensor.
"""

from __future__ import annotations

import json
import math
import re

FORMAT = "pipec.checkpoint/2"
READS = ("pipec.checkpoint/1", FORMAT)
MANIFEST = "manifest.json"
#: A manifest lists ~100 bytes per tensor: 64 MiB is half a million tensors.
MAX_BYTES = 64 << 20
#: safetensors' dtype codes (a file's header) and the torch dtype each one is, by name.
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
_SHA256 = re.compile(r"[0-9a-f]{64}")


class NotAManifest(ValueError):
    """What makes a file not a manifest of this form, in a few words."""


def parse(data: bytes) -> dict:
    """The manifest in `data`, checked for form (see the module doc); NotAManifest if not."""
    if len(data) > MAX_BYTES:
        raise NotAManifest(f"{len(data)} bytes, more than a manifest's {MAX_BYTES}")
    try:
        found = json.loads(data, parse_constant=_not_finite, parse_float=_finite)
    except RecursionError:
        raise NotAManifest("nested deeper than a manifest is") from None
    except UnicodeDecodeError:
        raise NotAManifest("not UTF-8 text") from None
    _check(found)
    return found


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotAManifest(f"{text}: not a finite number")
    return value


def _not_finite(text: str) -> float:
    raise NotAManifest(f"{text}: not a finite number")


def _check(found: object) -> None:
    """Raise ValueError naming the first part of `found` that is not a manifest's."""
    top = _mapping(found, "the manifest")
    if top.get("format") not in READS:
        raise NotAManifest(f"format {top.get('format')!r}, expected {FORMAT}")
    step = _count(top.get("step"), "step")
    for name, entry in _mapping(top.get("files"), "files").items():
        entry = _mapping(entry, f"files[{name!r}]")
        _count(entry.get("bytes"), f"files[{name!r}].bytes")
        if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            raise NotAManifest(f"files[{name!r}].sha256 is not a sha256")
    tensors = _mapping(top.get("tensors"), "tensors")
    for key, entry in tensors.items():
        entry = _mapping(entry, f"tensors[{key!r}]")
        if entry.get("file") not in top["files"]:
            raise NotAManifest(f"tensors[{key!r}] is in {entry.get('file')!r}, not a listed file")
        shape = entry.get("shape")
        if not isinstance(shape, list):
            raise NotAManifest(f"tensors[{key!r}].shape is not a list")
        for size in shape:
            _count(size, f"tensors[{key!r}].shape")
        if entry.get("dtype") not in DTYPES.values():
            dtype = entry.get("dtype")
            raise NotAManifest(f"tensors[{key!r}].dtype {dtype!r} is not one pipec writes")
    for key, target in _mapping(top.get("aliases", {}), "aliases").items():
        if key in tensors or target not in tensors:
            raise NotAManifest(f"aliases[{key!r}] is not another name of a tensor it lists")
    scalars = _mapping(top.get("scalars"), "scalars")
    for key, value in scalars.items():
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise NotAManifest(f"scalars[{key!r}] is a {type(value).__name__}, not a scalar")
    if scalars.get("step") != step or isinstance(scalars.get("step"), bool):
        raise NotAManifest(f"step {step} but scalars' step {scalars.get('step')!r}")
    if top.get("run") is not None:
        run = _mapping(top["run"], "run")
        for field in ("id", "model", "build"):
            if not isinstance(run.get(field), str):
                raise NotAManifest(f"run.{field} is not a string")
        if not isinstance(run.get("resumed_from"), (str, type(None))):
            raise NotAManifest("run.resumed_from is not a path")


def _mapping(value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise NotAManifest(f"{what} is not an object")
    return value


def _count(value: object, what: str) -> int:
    """`value` if it is an integer of 0 or more (JSON true is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise NotAManifest(f"{what} is {value!r}, not a count of 0 or more")
    return value
