"""Two cores, two processes: run one part of a large compile in a forked child, beside the rest.

A compile at p=64, m=1024 is a chain of pure-Python loops over 4·10^5 instructions, and
Python runs one loop per process. Some of those loops need nothing from each other: the
verifier's blocking execution and the simulation; printing the rank files and printing the
timeline. `beside` runs one of a pair in a forked child, which shares the parent's memory
copy-on-write and sends back only the exception it raised, if any.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Instructions below which the work runs inline: a fork and the copy-on-write faults after it
#: cost a few ms, more than a compile of 10^4 instructions saves by it.
MIN_FORKED_WORK = 50_000


@contextmanager
def beside(fn: Callable[[], None], work: int) -> Iterator[None]:
    """Run `fn()` in a forked child while the with-block runs here; when the block is done,
    wait for the child and raise what `fn` raised.

    The block's error comes first (the child is then killed): callers put the checks whose
    messages should win in the block. Below MIN_FORKED_WORK instructions of `work`, without
    `os.fork`, or while other Python threads run (a lock one of them holds would stay held
    in the child), `fn` runs here after the block: same results, same errors.
    """
    if work < MIN_FORKED_WORK or not hasattr(os, "fork") or threading.active_count() > 1:
        yield
        fn()
        return
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run fn, report, and leave without running the parent's cleanup
        os.close(read_end)
        status = 0
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            _send(write_end, exc)
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    try:
        yield
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        _reap(pid, read_end)
        raise
    report, status = _reap(pid, read_end)
    if report:
        raise pickle.loads(report)
    if status != 0:
        raise RuntimeError(f"pipec's child process {pid} died ({_exit_reason(status)})")


def _send(fd: int, exc: BaseException) -> None:
    """Write `exc`, pickled, to the parent (as a RuntimeError with the traceback's text when
    it does not pickle)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:  # noqa: BLE001 - an exception that does not round-trip
        text = "".join(traceback.format_exception(exc))
        data = pickle.dumps(RuntimeError(f"in pipec's child process:\n{text}"))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.close(fd)


def _reap(pid: int, fd: int) -> tuple[bytes, int]:
    """Everything the child wrote, and its wait status, once it has exited."""
    chunks = []
    with os.fdopen(fd, "rb") as pipe:
        while chunk := pipe.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks), status


def _exit_reason(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
