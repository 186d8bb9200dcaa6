"""Test-only fault injection: a rank that crashes or hangs on purpose, at a step of an attempt.

    PIPEC_FAULT="RANK:STEP:kill|stop[,RANK:STEP:kill|stop,...]"

Entry k (from 0) is for torchrun's attempt k (`TORCHELASTIC_RESTART_COUNT`), an empty one for
none. In that attempt rank RANK kills itself (`kill`: SIGKILL, a crash) or stops itself
(`stop`: SIGSTOP, a hang its own watchdog cannot end) at its first instruction of step STEP.
So a restarted run meets each fault once, and a test knows where it happened without timing
a signal from outside (tests/test_restarts.py). Runs without the variable are untouched: the
handlers are wrapped only on the rank an entry names.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from pipec.ir import Instr, Op
from pipec.runtime.interpreter import Handler
from pipec.runtime.rank import Rank

FAULT = "PIPEC_FAULT"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def inject(handlers: Mapping[Op, Handler], grank: int, attempt: int) -> Mapping[Op, Handler]:
    """`handlers`, or, when `FAULT` names rank `grank` in attempt `attempt`, handlers that
    send this process the fault's signal at its step's first instruction."""
    entries = os.environ.get(FAULT, "").split(",")
    entry = entries[attempt] if attempt < len(entries) else ""
    if not entry:
        return handlers
    rank, step, how = entry.split(":")
    if int(rank) != grank:
        return handlers
    fired = False

    def faulty(handler: Handler) -> Handler:
        def run(rt: Rank, instr: Instr) -> None:
            nonlocal fired
            if rt.step == int(step) and not fired:
                fired = True
                os.kill(os.getpid(), SIGNALS[how])
            handler(rt, instr)

        return run

    return {op: faulty(handler) for op, handler in handlers.items()}
