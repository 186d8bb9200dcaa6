"""One run at a time per build and per checkpoint directory: BUILD/measured/ (metrics.jsonl,
config.json, the timelines) holds one run's figures, never lines of two runs torn into each
other, and a `--save` directory one run's checkpoints, never two runs' saves interleaved (two
builds, or two copies of one, saving into one empty directory both pass its lineage check).

Rank 0 of a run holds an exclusive lock (`flock`) on BUILD/measured/.run.lock, and on
SAVE/.run.lock when it saves, for the whole run; the kernel drops them when the process ends,
however it ends. Each file says which process holds it. A second run is refused in one line:
by `pipec run` before torchrun starts (`check_free`), by launch.py's rank 0 (`hold`) under
torchrun.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from pipec.build_dir import MEASURED
from pipec.ir import PipecError

LOCK = ".run.lock"


def hold(build: Path, save: Path | None = None) -> list[int]:
    """Take the locks of `build` and of `save` (the run's --save directory, if any) for this
    process and say so in each; returns their file descriptors, to keep open for the run.
    PipecError, naming the holder, when another run holds one (and none is taken)."""
    fds: list[int] = []
    try:
        for lock in _locks(Path(build), save):
            lock.directory.mkdir(parents=True, exist_ok=True)
            fds.append(lock.take(os.O_CREAT))
            os.ftruncate(fds[-1], 0)
            os.write(fds[-1], f"pid {os.getpid()} on {socket.gethostname()}".encode())
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def check_free(build: Path, save: Path | None = None) -> None:
    """Raise PipecError when another run holds the lock of `build` or `save` (a probe: taken,
    then released; a lock file that is not there is free, and none is made)."""
    for lock in _locks(Path(build), save):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.close(lock.take(0))


@dataclass(frozen=True)
class _Lock:
    """The lock of `directory`, and what a refusal says: `busy` (holder), `remedy`."""

    directory: Path
    busy: str
    remedy: str

    def take(self, create: int) -> int:
        """Its lock file's descriptor, locked; PipecError naming the holder if held."""
        fd = os.open(self.directory / LOCK, os.O_RDWR | create, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace") or "another process"
            os.close(fd)
            raise PipecError(f"{self.busy} ({holder}); {self.remedy}") from None
        return fd


def _locks(build: Path, save: Path | None) -> list[_Lock]:
    locks = [
        _Lock(
            build / MEASURED,
            f"{build} is being run already",
            "one run of a build at a time (its measured/ is the run's): wait for it, or copy "
            "the build to run both",
        )
    ]
    if save is not None:
        locks.append(
            _Lock(
                Path(save),
                f"--save {save} is being saved into by another run",
                "one run per checkpoint directory: wait for it, or save elsewhere",
            )
        )
    return locks
