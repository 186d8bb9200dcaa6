"""Point-to-point messages: receives posted where the program says, waited where consumed.

A message is keyed (kind, producer stage, mb): the activation F(s, mb) sends on, the input
gradient B(s, mb) sends back, or a BPipe stash. `RECV_*` posts a non-blocking receive into
buffers shaped from the plan's boundary facts; the compute op that consumes it waits (the time
it waits is not counted as busy; on gloo the interpreter posts all of a step's receives at its
start, see `runtime.interpreter.run_program`). `SEND_*` is a non-blocking send (on gloo issued
by a helper thread, see `Comm`) whose buffer is kept until it completes; all sends are completed
before the optimizer step. Tags make gloo match by key; NCCL ignores tags and matches in order,
which the lowering's globally consistent message order guarantees.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from pipec.ir import Instr

if TYPE_CHECKING:
    from runtime.rank import Rank

MAX_TENSORS = 8  # tensors per message (a stage boundary); each gets its own tag


class Kind(enum.IntEnum):
    ACT = 0
    GRAD = 1
    STASH_SIZE = 2
    STASH = 3
    STASH_BACK = 4


class Comm:
    """One rank's posted receives and in-flight sends."""

    def __init__(
        self,
        global_rank: Callable[[int], int],
        n_stages: int,
        m: int,
        timeout: float,
        post_early: bool = False,
        send_thread: bool = False,
    ) -> None:
        self.global_rank = global_rank
        self.post_early = post_early  # the interpreter posts a step's receives at its start
        self.n_stages, self.m = n_stages, m
        self.timeout = timedelta(seconds=timeout)
        self.posted: dict[tuple[int, int, int], tuple[int, list, list[Tensor]]] = {}
        self.sending: list[tuple[object, Tensor]] = []
        self.waited = 0.0  # seconds spent waiting since the interpreter last read it
        self.waiting_on: tuple[int, Kind, int, int] | None = None  # (src, key) of a blocked wait
        # gloo: isends issued by a helper thread, in FIFO order. On 2 loaded cores 10-20% of
        # gloo isends blocked their caller for 5-19 ms (inside gloo; its I/O thread waiting for
        # a core), time a rank should spend computing. An error there is raised by the next
        # send or the drain.
        self._outbox: queue.Queue[tuple[int, int, Tensor]] | None = None
        self._send_error: Exception | None = None
        if send_thread:
            self._outbox = queue.Queue()
            threading.Thread(target=self._send_loop, name="pipec-send", daemon=True).start()

    def _send_loop(self) -> None:
        assert self._outbox is not None
        while True:
            dst, tag, t = self._outbox.get()
            try:
                if self._send_error is None:
                    self.sending.append((dist.isend(t, dst=dst, tag=tag), t))
            except Exception as e:  # noqa: BLE001 - handed to the main thread
                self._send_error = e
            finally:
                self._outbox.task_done()

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            raise self._send_error

    def _tag(self, kind: Kind, stage: int, mb: int, i: int) -> int:
        return ((kind * self.n_stages + stage) * self.m + mb) * MAX_TENSORS + i

    def post(self, kind: Kind, stage: int, mb: int, peer: int, buffers: Sequence[Tensor]) -> None:
        key = (kind, stage, mb)
        if key in self.posted:
            raise RuntimeError(f"{kind.name} s={stage} mb={mb} received twice")
        src = self.global_rank(peer)
        works = [
            dist.irecv(b, src=src, tag=self._tag(kind, stage, mb, i)) for i, b in enumerate(buffers)
        ]
        self.posted[key] = (src, works, list(buffers))

    def take(self, kind: Kind, stage: int, mb: int) -> tuple[Tensor, ...]:
        """Wait for a posted receive and return its buffers."""
        try:
            src, works, buffers = self.posted.pop((kind, stage, mb))
        except KeyError:
            raise RuntimeError(
                f"needs {kind.name} of stage {stage} mb {mb}, but no receive was posted for it"
            ) from None
        self.waiting_on = (src, kind, stage, mb)
        t0 = time.perf_counter()
        for w in works:
            w.wait(self.timeout)
        self.waited += time.perf_counter() - t0
        self.waiting_on = None
        return tuple(buffers)

    def send(self, kind: Kind, stage: int, mb: int, peer: int, tensors: Sequence[Tensor]) -> None:
        if len(tensors) > MAX_TENSORS:
            raise RuntimeError(f"{len(tensors)} tensors in one message; at most {MAX_TENSORS}")
        dst = self.global_rank(peer)
        if self._outbox is not None:
            self._raise_send_error()
            for i, t in enumerate(tensors):
                self._outbox.put((dst, self._tag(kind, stage, mb, i), t.detach().contiguous()))
            return
        # Release finished sends' buffers. gloo's send work reports completion only once
        # waited, so there they are all released at the optimizer step (drain); NCCL's sooner.
        self.sending = [(w, t) for w, t in self.sending if not w.is_completed()]
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            self.sending.append((dist.isend(t, dst=dst, tag=self._tag(kind, stage, mb, i)), t))

    def drain(self) -> None:
        """Complete every send; a receive left posted is a program error."""
        t0 = time.perf_counter()
        if self._outbox is not None:
            self._outbox.join()
            self._raise_send_error()
        for w, _ in self.sending:
            w.wait(self.timeout)
        self.waited += time.perf_counter() - t0
        self.sending.clear()
        if self.posted:
            kind, stage, mb = next(iter(self.posted))
            raise RuntimeError(
                f"{len(self.posted)} receives never consumed, e.g. {Kind(kind).name} s={stage} "
                f"mb={mb}"
            )

    def pop_waited(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited


def _buffers(rt: Rank, stage: int, which: str) -> list[Tensor]:
    return [
        torch.empty(shape, dtype=dtype, device=rt.device)
        for shape, dtype in rt.boundary(stage, which)
    ]


def recv_act(rt: Rank, instr: Instr) -> None:
    """Post the receive of stage s's input activation, produced by the previous stage."""
    prev = rt.layout.prev_stage(instr.stage)
    rt.comm.post(Kind.ACT, prev, instr.mb, instr.peer, _buffers(rt, instr.stage, "inputs"))


def recv_grad(rt: Rank, instr: Instr) -> None:
    """Post the receive of the gradient of stage s's output, produced by the next stage."""
    nxt = rt.layout.next_stage(instr.stage)
    rt.comm.post(Kind.GRAD, nxt, instr.mb, instr.peer, _buffers(rt, instr.stage, "outputs"))


def send_act(rt: Rank, instr: Instr) -> None:
    """Send F(s, mb)'s output on (non-blocking)."""
    tensors = rt.outbox.pop((Kind.ACT, instr.stage, instr.mb))
    rt.comm.send(Kind.ACT, instr.stage, instr.mb, instr.peer, tensors)


def send_grad(rt: Rank, instr: Instr) -> None:
    """Send B(s, mb)'s input gradient back (non-blocking)."""
    tensors = rt.outbox.pop((Kind.GRAD, instr.stage, instr.mb))
    rt.comm.send(Kind.GRAD, instr.stage, instr.mb, instr.peer, tensors)
