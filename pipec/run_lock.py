"""One run of a build at a time: BUILD/measured/ (metrics.jsonl, config.json, the timelines)
holds one run's figures, never lines of two runs torn into each other.

Rank 0 of a run holds an exclusive lock (`flock`) on BUILD/measured/.run.lock for the whole run;
the kernel drops it when the process ends, however it ends. The file says which process holds
it. A second run of the build is refused in one line: by `pipec run` before torchrun starts
(`check_free`), by launch.py's rank 0 (`hold`) under torchrun.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from pipec.build_dir import MEASURED
from pipec.ir import PipecError

LOCK = ".run.lock"


def hold(build: Path) -> int:
    """Take `build`'s lock for this process and say so in it; returns the file descriptor to
    keep open for the run. PipecError, naming the holder, when another run holds it."""
    fd = _take(Path(build))
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    return fd


def check_free(build: Path) -> None:
    """Raise PipecError when another run holds `build`'s lock (a probe: taken, then released)."""
    os.close(_take(Path(build)))


def _take(build: Path) -> int:
    measured = build / MEASURED
    measured.mkdir(exist_ok=True)
    fd = os.open(measured / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace") or "another process"
        os.close(fd)
        raise PipecError(
            f"{build} is being run already ({holder}); one run of a build at a time (its "
            "measured/ is the run's): wait for it, or copy the build to run both"
        ) from None
    return fd
