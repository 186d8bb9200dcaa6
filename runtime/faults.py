"""Faults: no run hangs forever, and the rank that notices says where it was.

Each rank runs a watchdog thread that knows which instruction the rank is executing and since
when. When one instruction takes longer than the timeout (a receive whose peer died or hangs,
a collective a peer never joins), it prints one line naming this rank, the instruction, its
line in the program and the peer it waits on, and ends the process with `EXIT_FAULT`.

torchrun stops the remaining ranks with SIGTERM once one fails. A Python signal handler would
only run after the blocking C++ wait returns, so instead SIGTERM is blocked in every thread
(`take_termination_signals`, called before torch starts its threads) and the watchdog takes it
with `sigtimedwait`, reporting where its rank was stopped. gloo's own timeout is set to the same
bound (`init_process_group(timeout=...)`), so a wait on a dead peer also fails on its own.

This module must not import torch: launch.py calls `take_termination_signals` first.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

EXIT_FAULT = 3
DEFAULT_TIMEOUT_S = 60.0


def take_termination_signals() -> None:
    """Block SIGTERM in this thread and the threads it starts later; the watchdog takes it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def report(message: str) -> None:
    """Print one line on stderr and end the process now (no atexit, no hanging destructors)."""
    sys.stdout.flush()
    sys.stderr.write(f"pipec runtime: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_FAULT)


class Watchdog:
    """Ends the process when one instruction runs longer than `timeout` or on SIGTERM.

    The interpreter calls `enter(k, now)` before instruction k and `leave()` after the
    program; `describe(k)` turns an index into 'rank 2: RECV_ACT s=2 mb=3 from=1 (...)'.
    """

    def __init__(self, timeout: float, describe: Callable[[int | None], str]) -> None:
        self.timeout = timeout
        self.describe = describe
        self.current: tuple[int, float] | None = None
        self.last: int | None = None  # the last instruction entered, for faults between steps
        self._stop = threading.Event()
        self._takes_sigterm = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self._thread = threading.Thread(target=self._watch, name="pipec-watchdog", daemon=True)
        self._thread.start()

    def enter(self, k: int, now: float) -> None:
        self.current = (k, now)
        self.last = k

    def where(self) -> str:
        """This rank and the instruction it is executing (or finished last, between steps)."""
        if self.current is not None:
            return self.describe(self.current[0])
        if self.last is None:
            return self.describe(None)
        return f"{self.describe(self.last)} done, between steps"

    def leave(self) -> None:
        self.current = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 10)
        while not self._stop.is_set():
            if self._takes_sigterm:
                if signal.sigtimedwait([signal.SIGTERM], poll) is not None:
                    report(
                        f"{self.where()}: stopped by SIGTERM "
                        "(torchrun stops every rank when one fails)"
                    )
            else:
                time.sleep(poll)
            where = self.current
            if where is not None and time.perf_counter() - where[1] > self.timeout:
                report(f"{self.describe(where[0])}: no progress for {self.timeout:g} s")
