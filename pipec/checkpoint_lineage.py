"""One lineage per checkpoint directory: which run wrote a checkpoint, where a run may save.

Every checkpoint records the run that saved it (its manifest's `run`, a `Lineage`): the model's
fingerprint, the build's plan hash, a run id new each run, and the checkpoint the run resumed
from. A directory of checkpoints holds one lineage: checkpoints of one model and one build, each
run continuing from a checkpoint of the directory.

- `check_save`: `--save DIR` is refused, in one line before any rank starts, when DIR holds
  checkpoints of another model or build, or when the run does not resume from DIR.
- `later_than`: resuming from an older checkpoint of DIR into DIR starts a new branch; the
  checkpoints after it are `set_aside` into DIR/abandoned-RUN/ (kept, never newest again).
- `prune`: after a save, only this run's own checkpoints beyond the newest `keep` go.
- `newest_of_run`: where a restarted attempt of a run resumes (runtime/restart.py).

The checkpoint a resume of DIR takes is pipec/checkpoint_files.py's `newest_intact`.
"""

from __future__ import annotations

import functools
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from pipec.checkpoint_files import checkpoints, manifest, step_dirs, verify
from pipec.checkpoint_manifest import MANIFEST
from pipec.ir import PipecError

ASIDE = "abandoned-"  # + the run id of the branch that abandoned them


@dataclass(frozen=True)
class Lineage:
    """What a run's checkpoints record of it (the manifest's `run`)."""

    model: str  # the fingerprint of the model's state_dict (pipec/provenance.py)
    build: str  # the build's plan hash
    id: str  # this run's: new each run, the same in every attempt of it (runtime/restart.py)
    resumed_from: str | None  # the absolute path of the checkpoint the run loaded

    @staticmethod
    def new(plan: dict, plan_hash: str, resume: Path | None, run: str | None = None) -> Lineage:
        """A run of the build of `plan` (hash `plan_hash`) resuming from `resume`: run `run`
        (each attempt of a restarted run gives the run's id), else a new one."""
        model = (plan.get("model") or {}).get("factory", {}).get("fingerprint", "")
        where = str(Path(resume).resolve()) if resume else None
        return Lineage(model, plan_hash, run or uuid.uuid4().hex[:16], where)

    def record(self) -> dict:
        return asdict(self)


def run_of(path: Path) -> dict | None:
    """The `run` that checkpoint `path` records (not to be changed: it is cached); None for a
    checkpoint of a pipec before lineages, or one whose manifest is not readable (it is never
    loaded either)."""
    try:
        seen = (Path(path) / MANIFEST).stat()
    except OSError:
        return None
    return _run_of(Path(path), seen.st_ino, seen.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _run_of(path: Path, inode: int, mtime_ns: int) -> dict | None:
    """`run_of` for the manifest file (`inode`, `mtime_ns`) of checkpoint `path`: a published
    manifest never changes, so a save's pruning reads only the new one (parsing each costs a
    background save time in the interpreter it shares with training: runtime/saving.py)."""
    try:
        return manifest(path).get("run")
    except PipecError:
        return None


def check_save(save: Path, resume: Path | None, lineage: Lineage) -> None:
    """Raise PipecError unless a run of `lineage` resuming from `resume` (as given: a directory
    of checkpoints or one of them) may save into `save`."""
    save = Path(save)
    held = step_dirs(save)
    if not held:
        return
    for path in held:
        run = run_of(path)
        if run is None:
            continue
        if run["model"] != lineage.model:
            raise PipecError(
                f"--save {save} holds checkpoints of another model ({path.name}); "
                "save into a directory of its own"
            )
        if run["build"] != lineage.build:
            raise PipecError(
                f"--save {save} holds checkpoints of another build ({path.name}: plan "
                f"{run['build']}, this build's is {lineage.build}); save into a directory of its "
                f"own (checkpoints move between builds: --resume {save} --save NEW)"
            )
    given = Path(resume).resolve() if resume is not None else None
    if given is None or save.resolve() not in (given, given.parent):
        raise PipecError(
            f"--save {save} already holds checkpoints (newest {held[-1].name}); continue them "
            f"with --resume {save}, or save elsewhere"
        )


def newest_of_run(directory: Path, run: str) -> Path | None:
    """The newest checkpoint in `directory` that run `run` saved and that verifies (None: none
    does), for a restarted attempt of the run to resume from."""
    for path in reversed(checkpoints(Path(directory))):
        if (run_of(path) or {}).get("id") == run:
            try:
                verify(path)
            except PipecError:
                continue
            return path
    return None


def later_than(save: Path, resumed: Path) -> list[Path]:
    """The checkpoints of `save` after checkpoint `resumed` when `resumed` is one of them
    (complete or not): those a run resuming from it into `save` abandons."""
    save = Path(save)
    if Path(resumed).resolve().parent != save.resolve():
        return []
    step = int(manifest(resumed)["step"])
    return [p for p in step_dirs(save) if int(p.name.removeprefix("step_")) > step]


def set_aside(save: Path, later: list[Path], lineage: Lineage) -> Path:
    """Move the checkpoints `later` into save/abandoned-RUN/ (one rename each); returns it."""
    aside = Path(save) / f"{ASIDE}{lineage.id}"
    aside.mkdir(exist_ok=True)  # a restarted run may finish the branch its first attempt began
    for path in later:
        path.rename(aside / path.name)
    sync(Path(save))
    return aside


def prune(directory: Path, lineage: Lineage, keep: int) -> None:
    """Remove the checkpoints of this run (`lineage`) in `directory` but its `keep` newest."""
    mine = [p for p in checkpoints(directory) if (run_of(p) or {}).get("id") == lineage.id]
    for path in mine[:-keep]:
        shutil.rmtree(path)


def sync(directory: Path) -> None:
    """Make renames in `directory` durable (a power cut after them must not undo them)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
