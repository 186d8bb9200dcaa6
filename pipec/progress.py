"""A line on stderr every few seconds while a long command runs: how long so far, and what it
is doing. Terminals, logs and pipes alike (a CI log or `pipec run`'s torchrun shows it too);
`PIPEC_PROGRESS=0` turns it off for scripts that read stderr for errors only.

Driven by SIGALRM, not a thread: a running thread would stop `pipec/beside.py` from forking
(a lock the thread holds would stay held in the child), and the compile's two-core speed-up
with it. The handler names the step from the stack it interrupts (the outermost module of
`steps` on it), so no pass needs to report anything, and a command shorter than FIRST_S prints
nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

FIRST_S = 3.0  # silent below this
EVERY_S = 5.0
Steps = tuple[tuple[str, str], ...]

#: Module prefix -> the step it does; the outermost one on the stack names what runs.
STEPS: Steps = (
    ("pipec.passes.registry", "building the schedule"),
    ("pipec.passes.schedules", "building the schedule"),
    ("pipec.passes.placement", "placing stages and evictions"),
    ("pipec.passes.lower", "lowering to sends and receives"),
    ("pipec.passes.simulate", "simulating"),
    ("pipec.passes.verify", "verifying"),
    ("pipec.passes.execution", "verifying"),
    ("pipec.beside", "verifying"),  # the compile waits for the verifier on the other core
    ("pipec.plan.profile_mbs", "profiling each micro-batch size"),
    ("pipec.plan.candidates", "pricing the candidates"),
    ("pipec.frontend", "tracing and measuring the model"),
    ("pipec.build_dir", "writing the files"),
)


def enabled() -> bool:
    """Whether progress lines are wanted: yes unless PIPEC_PROGRESS=0."""
    return os.environ.get("PIPEC_PROGRESS", "1") != "0"


@contextmanager
def progress(what: str, steps: Steps = STEPS) -> Iterator[None]:
    """Report on `what` (e.g. 'compiling 1f1b p=64 m=1024 v=1 (65536 stage ops...)') every
    EVERY_S seconds once FIRST_S have passed, to stderr, naming the step of `steps` that runs;
    nothing when turned off (`enabled`) or outside the main thread."""
    if (
        not enabled()
        or threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "setitimer")
    ):
        yield
        return
    start = time.monotonic()

    def report(signum: int, frame: FrameType | None) -> None:
        step = step_of(frame, steps)
        print(
            f"pipec: {what}: {time.monotonic() - start:.0f} s so far{', ' + step if step else ''}",
            file=sys.stderr,
            flush=True,
        )

    old = signal.signal(signal.SIGALRM, report)
    signal.setitimer(signal.ITIMER_REAL, FIRST_S, EVERY_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def step_of(frame: FrameType | None, steps: Steps = STEPS) -> str:
    """What the interrupted stack is doing: the step of its outermost module in `steps`."""
    step = ""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        step = next((s for prefix, s in steps if module.startswith(prefix)), step)
        frame = frame.f_back
    return step
