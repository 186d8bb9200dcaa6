"""A checkpoint's files: where checkpoints are, their manifest, and checking files against it.

A checkpoint `DIR/step_N` is complete when it has a manifest.json (its last file, of the form
pipec/checkpoint_manifest.py reads); `verify` checks every file the manifest lists (present,
its size, its sha256, the tensors its safetensors header holds, with their shapes and dtypes)
and names the first bad one. Nothing here unpickles: the manifest is JSON and a safetensors
header is JSON. pipec/checkpoint.py writes and loads checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from safetensors import safe_open

from pipec.checkpoint_manifest import DTYPES, MANIFEST, MAX_BYTES, parse
from pipec.ir import PipecError

_STEP = re.compile(r"^step_(\d{6,})$")
_OLD = ".metadata"  # torch.distributed.checkpoint's pickled metadata: the format before this one


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def step_dirs(directory: Path) -> list[Path]:
    """Every step_N directory in `directory`, complete or not, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory` (those with a manifest), oldest first."""
    return [p for p in step_dirs(Path(directory)) if (p / MANIFEST).is_file()]


def describe(path: Path) -> dict:
    """A file's size and sha256, read back from disk after an fsync (what a load will see)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def manifest(path: Path) -> dict:
    """Checkpoint `path`'s manifest, checked for form (not yet against the files)."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        if (path / _OLD).is_file():
            raise PipecError(
                f"{path}: a checkpoint in the old torch.distributed.checkpoint format, whose "
                "metadata is a pickle pipec no longer reads; save it again with this pipec"
            )
        raise PipecError(f"{path}: no {MANIFEST}, so not a complete checkpoint")
    try:
        with open(file, "rb") as f:
            found = parse(f.read(MAX_BYTES + 1))
        named = _STEP.match(path.name)
        if named and int(named[1]) != found["step"]:
            raise ValueError(f"step {found['step']} in a directory named {path.name}")
    except (ValueError, OSError) as e:
        raise PipecError(f"{file}: not a pipec checkpoint manifest ({e})") from None
    return found


def verify(path: Path) -> dict:
    """Check every file of checkpoint `path` against its manifest (size, then sha256); a
    PipecError names the first file that is missing, truncated or altered. Returns it."""
    path = Path(path)
    found = manifest(path)
    for name, entry in sorted(found["files"].items()):
        file = path / name
        if Path(name).name != name or not file.is_file():
            raise PipecError(f"{file}: missing from the checkpoint its manifest describes")
        if file.stat().st_size != entry["bytes"]:
            raise PipecError(
                f"{file}: {file.stat().st_size} bytes, the manifest says {entry['bytes']} "
                "(truncated or overwritten); resume from an earlier checkpoint"
            )
        if sha256(file) != entry["sha256"]:
            raise PipecError(
                f"{file}: its sha256 differs from the manifest's (the file is corrupted); "
                "resume from an earlier checkpoint"
            )
        _check_tensors(file, {k: e for k, e in found["tensors"].items() if e["file"] == name})
    return found


def _check_tensors(file: Path, listed: dict[str, dict]) -> None:
    """Raise PipecError unless safetensors file `file` holds exactly the `listed` tensors, with
    their shapes and dtypes (its header only: the data is not read)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            header = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118
            held = {k: (list(t.get_shape()), t.get_dtype()) for k, t in header.items()}
    except Exception as e:  # noqa: BLE001 - safetensors' own error type, or an OS error
        raise PipecError(f"{file}: not a safetensors file ({e})") from None
    if held.keys() != listed.keys():
        raise PipecError(f"{file}: its tensors are not those its manifest lists")
    for key, (shape, code) in sorted(held.items()):
        entry, dtype = listed[key], DTYPES.get(code, code)
        if (shape, dtype) != (entry["shape"], entry["dtype"]):
            raise PipecError(
                f"{file}: {key} is {dtype} {tuple(shape)} in the file, {entry['dtype']} "
                f"{tuple(entry['shape'])} in the manifest"
            )


def newest_intact(path: Path) -> tuple[Path, list[str]]:
    """`path` itself if it is one checkpoint (verified), else the newest checkpoint in it that
    verifies, with a notice for each newer one skipped; PipecError when there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (path / _OLD).is_file():
        verify(path)
        return path, []
    skipped: list[str] = []
    candidates = step_dirs(path)
    for candidate in reversed(candidates):
        try:
            verify(candidate)
        except PipecError as e:
            skipped.append(f"skipping {candidate.name}: {e}")
            continue
        return candidate, skipped
    if candidates:  # say why the newest is unusable
        manifest(candidates[-1])
        verify(candidates[-1])
    raise PipecError(
        f"{path}: no checkpoint here (no complete step_NNNNNN directory); "
        f"save one with launch.py --save {path}"
    )
