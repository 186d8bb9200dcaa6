"""torchrun as pipec starts it: every store it serves listens only where its address says, and
it ends with the process that started it.

    python -m pipec.runtime.agent [torchrun's options] SCRIPT [ARGS]

torchrun's TCP stores (the c10d rendezvous's, and the one its ranks bootstrap from) listen on
every interface, IPv4 and IPv6, whatever address they are given: anyone who reaches the
machine can read and set their keys, unauthenticated. Here each store this agent serves listens
on its own address only: a socket bound to it is handed to the store (TCPStore's
`master_listen_fd`). `pipec run` gives 127.0.0.1 (the rendezvous endpoint and `--local-addr`,
the ranks' MASTER_ADDR), so a run on one machine listens on loopback alone; a run on several
nodes listens on the endpoint's address (rendezvous) and `--local-addr` (the ranks' store).

Started by `pipec run` (PARENT_PID set), the agent dies with it (runtime/faults.py's
`end_with_parent`), and its ranks die with the agent: SIGKILL to `pipec run` ends the run.

When a rank fails (`Agent`), torchrun stops the group and, with `--max-restarts N`, starts it
again. A rank found stopped then (SIGSTOP, a debugger: its peers timed out waiting on it) is
killed at once, not after torchrun's 30 s of waiting for it to end; a group whose failed ranks
all refused their input (exit 2) is not restarted, since it would refuse again; and each
failure is recorded for `pipec run` (runtime/failures.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import run
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
from torch.distributed.launcher import api as launcher

from pipec.runtime.failures import RECORDS, Failure, RankEnd
from pipec.runtime.faults import PARENT_PID, STEP_KEY, end_with_parent

#: A rank's exit code for input it refused before anything ran (runtime/main.py).
EXIT_INPUT = 2


class BoundStore(dist.TCPStore):
    """A TCPStore whose server listens on `host_name`'s address only (not every interface)."""

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        **kwargs: object,
    ) -> None:
        if is_master and kwargs.get("master_listen_fd") is None:
            family, *_, address = socket.getaddrinfo(host_name, port, type=socket.SOCK_STREAM)[0]
            try:
                server = socket.create_server(address, family=family)
            except OSError as e:  # as TCPStore's own failure to listen, which torchrun retries
                raise RuntimeError(e.strerror or str(e)) from None
            port = server.getsockname()[1]
            kwargs["master_listen_fd"] = server.detach()  # the store closes it
        super().__init__(host_name, port, world_size, is_master, **kwargs)


class Agent(LocalElasticAgent):
    """torchrun's agent, which also kills a stopped rank at once, restarts no group that
    refused its input, and records each failure (with `RECORDS` set, on stderr)."""

    _failed: RunResult | None = None
    _stopped: frozenset[int] = frozenset()  # the global ranks found stopped, and killed
    _ended: frozenset[int] = frozenset()  # those that had ended before the group was stopped
    _restarting = False

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        close = self._pcontext.close  # called when a rank has failed, and at every shutdown

        def close_after_looking(*args: object, **kwargs: object) -> None:
            self._look_before_closing()
            close(*args, **kwargs)

        self._pcontext.close = close_after_looking
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED:
            self._failed = result
            if all(f.exitcode == EXIT_INPUT for f in result.failures.values()):
                self._remaining_restarts = 0
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._restarting = True
        try:
            super()._restart_workers(worker_group)
        finally:
            self._restarting = False

    def _look_before_closing(self) -> None:
        """Before torchrun closes the ranks' processes: note which had ended by themselves
        (the failure's cause is among them), and SIGKILL each that is stopped (SIGSTOP, a
        debugger): it takes no other signal, and torchrun would wait 30 s for it to end after
        its SIGTERM."""
        workers = self._worker_group.workers
        for local, pid in self._pcontext.pids().items():
            state, rank = _state(pid), workers[local].global_rank
            if state in ("T", "t"):
                os.kill(pid, signal.SIGKILL)
                self._stopped |= {rank}
            elif state in ("", "Z", "X"):  # collected by torchrun already, or not yet
                self._ended |= {rank}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        super()._stop_workers(worker_group)
        if self._failed is not None and RECORDS in os.environ:
            sys.stderr.write(self._failure(worker_group, self._failed).to_line())
            sys.stderr.flush()
        self._failed = None
        self._stopped = self._ended = frozenset()

    def _failure(self, worker_group: WorkerGroup, result: RunResult) -> Failure:
        """What the stopped group's ranks ended with: torchelastic's exit codes, the ranks
        found stopped or ended by themselves, and each rank's error file."""
        spec = worker_group.spec
        ends = []
        for worker in worker_group.workers:
            rank = worker.global_rank
            failure = result.failures.get(rank)
            said = _error_file(self._pcontext.error_files.get(worker.local_rank, ""))
            stopped, ended = rank in self._stopped, rank in self._ended
            ends.append(RankEnd(rank, failure and failure.exitcode, stopped, ended, **said))
        restart = spec.max_restarts - self._remaining_restarts if self._restarting else None
        return Failure(tuple(ends), restart, spec.max_restarts)


def _state(pid: int) -> str:
    """Process `pid`'s state (Linux /proc: T or t when stopped; '' when unknown)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _error_file(path: str) -> dict:
    """The message and step a rank left in its error file (runtime/faults.py), if any."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    message = data.get("message")
    text = message.get("message", "") if isinstance(message, dict) else str(message or "")
    step = data.get(STEP_KEY)
    return {"message": text, "step": step if isinstance(step, int) else None}


def main(argv: list[str]) -> None:
    """torchrun's main on `argv`, its stores `BoundStore`s, its agent `Agent`."""
    if PARENT_PID in os.environ:  # started by pipec run (or a test): end with it
        end_with_parent()
    os.environ[PARENT_PID] = str(os.getpid())  # the ranks end with this process
    dist.TCPStore = BoundStore  # read at each call by the rendezvous handler's store
    c10d_rendezvous_backend.TCPStore = BoundStore  # imported by name
    static_tcp_rendezvous.TCPStore = BoundStore
    launcher.LocalElasticAgent = Agent
    if RECORDS in os.environ:  # each failure is recorded: torchelastic's lines of it are not
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
            logging.CRITICAL
        )
    # run.run, not run.main: main's wrapper copies a failed rank's error file into an error
    # file of the agent's own, and without one says so as an error.
    run.run(run.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
