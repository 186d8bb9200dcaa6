"""How pipec starts torchrun: this interpreter's torchrun (runtime/agent.py), on a free port;
and `pipec run BUILD`, which checks the run, runs the build under torchrun, passes a stop signal
on to every rank and says last what went wrong.

A run listens on loopback only: the rendezvous is torchrun's c10d store on 127.0.0.1, port 0 (a
free one, so runs and tests of several engineers on one machine never collide), the ranks'
store on 127.0.0.1 (`--local-addr`), each bound there by runtime/agent.py (torchrun alone, and
`--standalone`, listen on every interface), and the ranks' gloo (or NCCL) sockets on the
loopback interface. torchrun ends with the process that started it, its ranks with torchrun.
The ranks import pipec as this process does: installed, or from a checkout the environment's
PYTHONPATH names.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipec import NO_NUMPY_WARNING
from pipec.checkpoint_files import manifest, newest_intact
from pipec.ir import PipecError
from pipec.runtime.failures import RECORDS, Failure
from pipec.runtime.faults import GRACE_S, PARENT_PID
from pipec.runtime.restart import RUN_ID, resume_from

if TYPE_CHECKING:
    from pipec.runtime.config import CheckpointConfig

#: The loopback interface (Linux's name), for the ranks' own sockets: gloo and NCCL otherwise
#: listen on the address the host name resolves to, often an external one.
LOOPBACK = "lo"
SOCKET_INTERFACES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def torchrun(
    script: Path, nproc: int, *args: str, max_restarts: int = 0
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run `script` on `nproc` local ranks, every socket
    on loopback, torchrun ending with this process and restarting the ranks up to
    `max_restarts` times; a new run id (its rendezvous id too), which every rank of every
    attempt is given (runtime/restart.py)."""
    run = uuid.uuid4().hex[:16]
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    cmd = [
        sys.executable, "-m", "pipec.runtime.agent", "--nnodes", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", run,
        "--local-addr", "127.0.0.1", *restarts, "--nproc-per-node", str(nproc), str(script),
        *args,
    ]  # fmt: skip
    # torchrun imports torch before pipec: its numpy warning is silenced here as pipec/__init__.py
    # silences it in pipec's own processes.
    warnings = ",".join(filter(None, [NO_NUMPY_WARNING, os.environ.get("PYTHONWARNINGS")]))
    env = os.environ | {"PYTHONWARNINGS": warnings, PARENT_PID: str(os.getpid()), RUN_ID: run}
    if any(name == LOOPBACK for _, name in socket.if_nameindex()):
        env = {name: LOOPBACK for name in SOCKET_INTERFACES} | env  # unless the user chose
    if nproc > 1:  # what torchrun sets then, here without its banner (the ranks set theirs)
        env = {"OMP_NUM_THREADS": "1"} | env
    return cmd, env


_MESSAGE = "pipec runtime: "


def run_build(build: Path, nproc: int | None, args: Sequence[str], max_restarts: int = 0) -> int:
    """Train `build` under torchrun on this machine; its output passes through as it comes.

    First `check_run` (one line, before any rank starts). torchrun runs in a session of its
    own, so only pipec decides what reaches it: SIGTERM, SIGINT or SIGHUP to pipec is passed on
    as SIGTERM (torchrun passes it to every rank, which finishes its step, saves when --save
    is set and exits; see runtime/faults.py), a second one kills torchrun and its ranks. pipec
    killed outright (SIGKILL: the OOM killer, a CI cancel) takes torchrun and its ranks with it
    (runtime/agent.py): no rank trains on.

    With `max_restarts` N, torchrun restarts the ranks after a failure, up to N times, each
    restart resuming from the run's newest intact checkpoint in --save (runtime/restart.py);
    each failure is said in one line from torchrun's record of it (runtime/failures.py):
    `pipec run: rank 1 killed (SIGKILL) at step 7; restart 1 of 3 from step 6`.

    On failure torchrun ends with its own report (a ChildFailedError traceback and a table of
    failed ranks) below the line a rank printed to say what went wrong. Once a rank has said
    why, that report is condensed to one line (`_Condense`); without such a line it passes
    through whole, since it is then all there is. The rank's line (of the last attempt) is
    repeated last, as `pipec run: ...`, and the failure's exit code returned (2: bad input,
    nothing ran; 3: a fault during the run, a hung rank included; 1: --check-grads found a
    difference; 128 + the signal's number for a rank killed by one, or after a stop).
    """
    from pipec.run_checks import check_run

    checked = check_run(Path(build), nproc, args, max_restarts)
    if checked is None:  # --help: printed
        return 0
    ranks, config = checked
    cmd, env = torchrun(Path(build) / "launch.py", ranks, *args, max_restarts=max_restarts)
    print(
        f"pipec run: {ranks} ranks under torchrun; each reads and verifies {build}, rebuilds its "
        "stages from the model's factory, then runs its program",
        file=sys.stderr,
        flush=True,
    )
    env[RECORDS] = "1"
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stop = _Forward(proc)
    messages, failures = [], []
    condense = _Condense()
    with stop:
        for line in proc.stderr:
            if failure := Failure.parse(line):
                failures.append(failure)
                if max_restarts:
                    resumed = _resumed(config.checkpoint, env[RUN_ID]) if failure.restart else None
                    print(f"pipec run: {failure.line(resumed)}", file=sys.stderr, flush=True)
                if failure.restart:  # a new attempt: its own messages say why it fails
                    messages = []
                continue
            said = line[line.index(_MESSAGE) + len(_MESSAGE) :].strip() if _MESSAGE in line else ""
            if said and not said.startswith("notice:"):  # a notice is not why a run failed
                messages.append(said)
            sys.stderr.write(condense(line, bool(messages) or bool(stop.signum)))
        sys.stderr.write(condense.rest())
        code = proc.wait()
    if stop.signum:
        said = next((m for m in messages if m.startswith("stopped by")), None)
        print(f"pipec run: {said or f'stopped by {signal.Signals(stop.signum).name}'}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 128 + stop.signum
    if code == 0:
        return 0
    said = messages[0] if messages else "a rank failed without a message; see torchrun's report"
    print(f"pipec run: {said}", file=sys.stderr, flush=True)
    # The failed ranks' exit codes and signals, from torchelastic's records (runtime/agent.py);
    # none when no rank failed (torchrun's own failure): then torchrun's code.
    return failures[-1].code() if failures else code


def _resumed(checkpoints: CheckpointConfig, run: str) -> int | None:
    """The step a restart of run `run` resumes from (None: from the start), found as its ranks
    find it (runtime/restart.py), while none of them runs."""
    point = resume_from(checkpoints.save, checkpoints.resume, run)
    if point is None:
        return None
    try:
        return int(manifest(newest_intact(point)[0])["step"])
    except PipecError:  # the ranks will say why, in their first lines
        return None


class _Forward:
    """While in use, pipec's stop signals go to torchrun: the first as SIGTERM (a stop after
    the step under way), a second as SIGKILL to torchrun and every process under it. After the
    first, a thread bounds the stop: torchrun gets `LINGER_S` once its ranks are gone (its own
    teardown took seconds more here), everything `GRACE_S` + `LINGER_S` in all."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    LINGER_S = 1.0

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.signum = 0
        self._before: dict[int, object] = {}

    def __enter__(self) -> None:
        for sig in self.SIGNALS:
            self._before[sig] = signal.signal(sig, self._on_signal)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum:
            self._kill()
            return
        self.signum = signum
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        threading.Thread(target=self._bound, daemon=True).start()

    def _bound(self) -> None:
        deadline = time.monotonic() + GRACE_S + self.LINGER_S
        ranks_gone = None
        while self.proc.poll() is None and time.monotonic() < deadline:
            if ranks_gone is None and not _descendants(self.proc.pid):
                ranks_gone = time.monotonic()
            if ranks_gone is not None and time.monotonic() - ranks_gone > self.LINGER_S:
                break
            time.sleep(0.1)
        self._kill()

    def _kill(self) -> None:
        """SIGKILL torchrun and every process under it (if it has not exited yet)."""
        if self.proc.poll() is not None:
            return
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux /proc), children first."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


class _Condense:
    """torchrun's failure report as one line, once a rank has said why it failed.

    The report is its launcher's traceback, ending in `ChildFailedError:`, then a table of the
    failed ranks between two `====` rules. A traceback is held back until its exception line
    shows whose it is: a rank's own (or any other) is written out whole; torchrun's, with the
    table after it, becomes `torchrun: rank R failed first, then ranks ...`. Called with a
    line, it returns what to write now. The report is torch's text, not a record:
    tests/test_torch_texts.py pins it."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.ranks: list[str] = []
        self.rules = 0  # `====` rules seen in the table; 0 outside it

    def __call__(self, line: str, said: bool) -> str:
        if self.rules:
            if m := re.match(r"\s*rank\s*:\s*(\d+)", line):
                self.ranks.append(m[1])
            if line.startswith("===="):
                self.rules += 1
            if self.rules < 3:
                return ""
            self.rules = 0
            *others, first = self.ranks or ["?"]  # the table ends with the root cause
            self.ranks = []
            then = f", then {'ranks' if len(others) > 1 else 'rank'} " if others else ""
            return f"torchrun: rank {first} failed first{then}{', '.join(others)}\n"
        if not self.held:
            if line.startswith("Traceback (most recent call last):") and said:
                self.held = [line]
                return ""
            return line
        self.held.append(line)
        if line[:1].isspace():
            return ""
        held, self.held = "".join(self.held), []
        if "SignalException" in line:  # torchrun's own, when stopped: pipec's line says it
            return ""
        if "ChildFailedError" in line:
            self.rules = 1
            return ""
        return held

    def rest(self) -> str:
        """What is still held when the stream ends (a traceback cut short)."""
        held, self.held = "".join(self.held), []
        return held
