"""Faults: no run hangs forever, and the rank that notices says where it was.

Each rank runs a watchdog thread that knows which instruction the rank is executing and since
when. When one instruction takes longer than the timeout (a receive whose peer died or hangs,
a collective a peer never joins), it prints one line naming this rank, the instruction, its
line in the program and the peer it waits on, and ends the process with `EXIT_FAULT`.

SIGTERM and SIGINT come from torchrun, which passes them on when it is stopped (a cluster
preempting the job, `pipec run` stopped) and sends SIGTERM once a rank has failed. A Python
signal handler would only run after the blocking C++ wait returns, so instead both are blocked
in every thread (`take_termination_signals`, called before torch starts its threads) and the
watchdog takes them with `sigtimedwait`. The first asks the rank to stop (`stopping`): the
training loop finishes the step under way, agrees with the other ranks to stop after it, saves
a last checkpoint and exits. A rank that cannot finish its step, because it has waited on one
instruction for `STALL_S` (a dead or hung peer: torchrun's failure stop) or has not exited
`GRACE_S` after the signal, or that gets a second signal, is ended at once with a line saying
where it was. gloo's own timeout is set to the same bound as the watchdog's
(`init_process_group(timeout=...)`), so a wait on a dead peer also fails on its own.

The line a rank ends with also goes to torchrun's error file for the rank
(`TORCHELASTIC_ERROR_FILE`, in torchelastic's own form) with the step the rank was at, so that
torchrun's agent knows why and where each rank of a failed group ended (runtime/agent.py).

A rank ends with torchrun (`end_with_parent`): killed by the kernel the moment torchrun
exits, so that torchrun killed with SIGKILL (its parent `pipec run` killed by the OOM killer or
a CI cancel, runtime/agent.py) leaves no rank training on and saving into `--save`.

This module must not import torch: launch.py calls `take_termination_signals` first.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn, Self

EXIT_FAULT = 3
#: The key of the step in a rank's error file (beside torchelastic's own `message`).
STEP_KEY = "pipec_step"
#: The pid of the process that started this one, set by the process that starts it
#: (`pipec run` for torchrun, pipec's torchrun for its ranks): see `end_with_parent`.
PARENT_PID = "PIPEC_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEFAULT_TIMEOUT_S = 60.0
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# After a stop signal: an instruction waited on this long will not finish (its peer is gone);
# the whole stop (the step, the last checkpoint) takes at most GRACE_S, under the 30 s torchrun
# waits before it kills its ranks.
STALL_S = 5.0
GRACE_S = 20.0


def take_termination_signals() -> None:
    """Block SIGTERM and SIGINT in this thread and the threads it starts later; the watchdog
    takes them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def end_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent exits, however it exits (Linux's
    parent-death signal; elsewhere nothing). A parent gone already, before this call (its pid
    no longer this process's parent pid, when PARENT_PID names it), ends the process now."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = os.environ.get(PARENT_PID)
    if parent and os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGKILL)


def report(message: str, step: int | None = None) -> NoReturn:
    """Print one line on stderr, leave it and the `step` under way (None: before the first) in
    torchrun's error file, and end the process now (no atexit, no hanging destructors)."""
    sys.stdout.flush()
    sys.stderr.write(f"pipec runtime: {message}\n")
    sys.stderr.flush()
    leave_error_file(message, step)
    os._exit(EXIT_FAULT)


def leave_error_file(message: str, step: int | None) -> None:
    """Write `message` where torchrun reads why a rank failed (`TORCHELASTIC_ERROR_FILE`, which
    its agent sets for each rank; nothing without it), in the form torchelastic's own error
    handler writes, plus the step (`STEP_KEY`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": "", "timestamp": str(int(time.time()))}
    data = {"message": {"message": message, "extraInfo": extra}, STEP_KEY: step}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the line on stderr is said already; torchrun then reports the exit code
        pass


class Watchdog:
    """Ends the process when one instruction runs longer than `timeout` or on SIGTERM.

    The interpreter sets `current = (k, now)` before instruction k (an attribute, not a call:
    it is the loop's hot path) and calls `leave()` after the program; `describe(k)` turns an
    index into 'rank 2: RECV_ACT s=2 mb=3 from=1 (...)'. The training loop sets `step`, the step
    under way, which a fault's error file records.
    """

    def __init__(self, timeout: float, describe: Callable[[int | None], str]) -> None:
        self.timeout = timeout
        self.describe = describe
        self.current: tuple[int, float] | None = None
        self.last: int | None = None  # the last instruction entered, for faults between steps
        self.step: int | None = None  # the step under way (None: training has not begun)
        self._stop = threading.Event()
        self.stopping = threading.Event()  # a stop signal came: finish this step, then stop
        self.signal_name = ""
        self._signalled_at = 0.0
        self._takes_signals = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self._thread = threading.Thread(target=self._watch, name="pipec-watchdog", daemon=True)
        self._thread.start()

    def where(self) -> str:
        """This rank and the instruction it is executing (or finished last, between steps)."""
        if self.current is not None:
            return self.describe(self.current[0])
        if self.last is None:
            return self.describe(None)
        return f"{self.describe(self.last)} done, between steps"

    def leave(self) -> None:
        if self.current is not None:
            self.last = self.current[0]
        self.current = None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stopped however the block ends: a watchdog left running in a process that goes on
        (a test's) would end it once its instruction's timeout passes."""
        self.stop()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 10)
        while not self._stop.is_set():
            if self._takes_signals:
                got = signal.sigtimedwait(STOP_SIGNALS, poll)
                if got is not None:
                    self._signalled(signal.Signals(got.si_signo).name)
            else:
                time.sleep(poll)
            where, now = self.current, time.perf_counter()
            if where is not None and now - where[1] > self.timeout:
                report(f"{self.describe(where[0])}: no progress for {self.timeout:g} s", self.step)
            if not self.stopping.is_set():
                continue
            if where is not None and now - where[1] > STALL_S:
                report(
                    f"{self.where()}: stopped by {self.signal_name} (its step cannot finish)",
                    self.step,
                )
            if now - self._signalled_at > GRACE_S:
                report(
                    f"{self.where()}: stopped by {self.signal_name}, not done in {GRACE_S:g} s",
                    self.step,
                )

    def _signalled(self, name: str) -> None:
        """The first stop signal asks for a stop after this step; a second one ends it now."""
        if self.stopping.is_set():
            report(f"{self.where()}: stopped by a second {name}", self.step)
        self.signal_name = name
        self._signalled_at = time.perf_counter()
        self.stopping.set()
