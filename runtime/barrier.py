"""Between steps: the barrier every step starts with, and naming the rank that left.

Inside a step a dead peer is named by the instruction that waits on it (runtime/faults.py).
Between steps no instruction waits on anyone: a rank that dies there is met by the barrier or
by the wait on the previous step's gathered figures (runtime/loop.py), where gloo's error
names only a socket address. So at each barrier every rank notes in the store where it
arrived and which process it is (`Arrival`); when a wait between steps fails, the ranks still
there read the notes and say which rank never arrived, or whose process on this machine has
exited or is stopped (`who_left`). The notes, not gloo's message, also name the ranks rank 0's
barrier timed out waiting for. Of gloo's text only its gist is kept beside them (`GLOO_GIST`,
pinned by tests/test_torch_texts.py).
"""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

ARRIVED = "pipec/arrived/"  # + rank: the rank's last `Arrival` (a key of the default store)
FAILED = "pipec/failed/"  # + rank: set by a rank whose wait failed, before it exits
# Rank 0 gives up on the barrier this much sooner than the others give up on rank 0, so that
# it is the one to report, naming the ranks that never arrived.
BARRIER_SHARE = 0.75
#: The gist of gloo's error for a peer gone: 'Connection closed by peer [127.0.0.1]:6344'.
GLOO_GIST = re.compile(r"\] ([^\[\n].*?)\. This is typically")
# A killed process closes its sockets before it becomes a zombie: how long a rank whose
# connection closed looks for the process that closed it.
EXIT_SEEN_S = 1.0


@dataclass(frozen=True)
class Arrival:
    """A rank's note in the store: the barrier it last arrived at, and its process (`machine`
    tells whether another rank can look the pid up)."""

    where: str
    machine: str
    pid: int

    def text(self) -> str:
        return f"{self.machine} {self.pid} {self.where}"

    @staticmethod
    def parse(text: str) -> Arrival:
        machine, pid, where = text.split(" ", 2)
        return Arrival(where, machine, int(pid))


@functools.cache
def this_machine() -> str:
    """The machine and pid namespace this process sees, '' where unknown (no /proc): two ranks
    with the same one can see each other's pids."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid').strip('pid:[]')}"
    except OSError:
        return ""


def step_barrier(where: str, timeout: float) -> None:
    """Wait until every rank is here; on gloo, a rank that is not says which ranks are missing.
    (NCCL's own watchdog reports a dead peer; there the barrier adds no store traffic.)"""
    if dist.get_backend() != "gloo":
        dist.barrier()
        return
    store = _get_default_store()  # torch's own store of the default group
    store.set(f"{ARRIVED}{dist.get_rank()}", Arrival(where, this_machine(), os.getpid()).text())
    wait = timeout * BARRIER_SHARE if dist.get_rank() == 0 else timeout
    t0 = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=wait), wait_all_ranks=True)
    except RuntimeError as e:
        # Rank 0 monitors the barrier: timed out (not a connection closed first), it names the
        # ranks whose note is not this barrier's.
        timed_out = time.monotonic() - t0 >= 0.9 * wait
        if timed_out and dist.get_rank() == 0:
            try:
                missing = _never(_notes(store), where)
            except RuntimeError:  # the store is gone too: gloo's message is all there is
                missing = []
            if missing:
                raise RuntimeError(
                    f"{_ranks(missing)} did not reach the barrier {where} in {wait:g} s"
                ) from None
        raise who_left(e, f"at the barrier {where}", where) from None


def who_left(error: RuntimeError, during: str, barrier: str | None = None) -> RuntimeError:
    """`error`, a wait between steps that failed, as the ranks that left `during` it: those
    whose last note is not `barrier` (when waiting at one) and those whose process on this
    machine has exited or is stopped. `error` itself when no rank is found (another machine, a
    rank hung in a wait of its own)."""
    try:
        said = _left(_get_default_store(), during, barrier)
    except RuntimeError:  # the store is gone too (its host died): gloo's message is all there is
        return error
    return RuntimeError(f"{said}: {_gloo_says(error)}") if said else error


def _left(store: dist.Store, during: str, barrier: str | None) -> str:
    """What `who_left` says: the ranks that never reached `barrier`, or else those whose
    process exited or is stopped (looked for up to EXIT_SEEN_S); "" when none is found."""
    store.set(f"{FAILED}{dist.get_rank()}", during)  # this rank will exit, but did not leave
    notes = _notes(store)
    never = _never(notes, barrier) if barrier else []
    if never:
        return f"{_ranks(never)} never reached the barrier {barrier}"
    deadline = time.monotonic() + EXIT_SEEN_S
    while time.monotonic() < deadline:
        state = {r: _state(n) for r, n in notes.items() if n}
        # A rank that exited after its own wait failed (its note set before it exited) is not
        # the one that left.
        exited = [
            r for r, how in state.items() if how == "exited" and not store.check([FAILED + str(r)])
        ]
        stopped = [r for r, how in state.items() if how == "stopped"]
        said = [f"{_ranks(exited)} exited {during}"] if exited else []
        said += [f"{_ranks(stopped)} stopped (SIGSTOP, a debugger) {during}"] if stopped else []
        if said:
            return "; ".join(said)
        time.sleep(0.05)
    return ""


def _notes(store: dist.Store) -> dict[int, Arrival | None]:
    """Every rank's last note (None: it has noted nothing yet)."""
    notes: dict[int, Arrival | None] = {}
    for rank in range(dist.get_world_size()):
        key = f"{ARRIVED}{rank}"
        notes[rank] = Arrival.parse(store.get(key).decode()) if store.check([key]) else None
    return notes


def _never(notes: dict[int, Arrival | None], barrier: str) -> list[int]:
    """The ranks whose last note is not `barrier`: they never arrived there."""
    return [r for r, n in notes.items() if n is None or n.where != barrier]


def _gloo_says(error: RuntimeError) -> str:
    """The gist of gloo's error (`GLOO_GIST`), else its first line."""
    text = str(error)
    gist = GLOO_GIST.search(text)
    return gist[1] if gist else text.splitlines()[0][:200]


def _state(note: Arrival) -> str:
    """The process of `note`: "exited", "stopped" (it never comes back by itself) or "" (running,
    or on another machine, where it cannot be looked up)."""
    if not note.machine or note.machine != this_machine():
        return ""
    try:
        state = Path(f"/proc/{note.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "exited"
    if state in ("Z", "X"):  # a zombie has exited; its parent has not collected it yet
        return "exited"
    return "stopped" if state in ("T", "t") else ""


def _ranks(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
