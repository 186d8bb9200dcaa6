"""Point-to-point messages: one place where a send or receive is issued and completed.

A message is keyed (kind, producer stage, mb): the activation F(s, mb) sends on, the input
gradient B(s, mb) sends back, or a BPipe stash going out (STASH) or coming back (STASH_BACK).
Every size is known from the plan on both sides (stage boundaries from the model's facts, a
stash's flat buffer from its measured bytes), so no message ever carries a size and no receive
waits on the host for one.

Receives: `post` issues a non-blocking receive into buffers the caller allocated; `take` waits
for it and hands the buffers over (the consuming instruction; the time it waits is not busy
time). Where the interpreter posts them is the backend's policy (`passes.memory_bytes.POST_AHEAD`).

Sends: `send` issues a non-blocking send and keeps its tensors in `in_flight` only until it
completes; `poll`, which the interpreter calls after every instruction, lets completed ones go,
so a sent buffer lives from its send to the first instruction boundary after it arrived, never
to the end of the step. On gloo a send work reports completion only once waited, and an
`isend` can block its caller for milliseconds when the receiver has not posted yet (its I/O
thread waits for a core), so each destination has a lane: a thread that issues that
destination's sends in program order, waits for each, and drops its tensors the moment it
completes. With NCCL the sends are issued here and `poll` asks each work whether it completed.
`drain` (the optimizer step) only waits for what is still in flight.

Tags make gloo match by key; NCCL ignores tags and matches in order, which the lowering's
globally consistent message order guarantees.
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
    STASH = 2
    STASH_BACK = 3


class Send:
    """One message in flight: `tensors` are referenced until the send completes.

    `issued_at` and `completed_at` are the sender's instruction clock (`Comm.clock`) when it
    was issued and when its completion was seen."""

    __slots__ = ("completed_at", "done", "dst", "issued_at", "key", "tensors", "works")

    def __init__(self, key: tuple[Kind, int, int], dst: int, tensors: tuple[Tensor, ...], at: int):
        self.key, self.dst, self.tensors, self.issued_at = key, dst, tensors, at
        self.works: list = []
        self.completed_at: int | None = None
        self.done = threading.Event()  # set by the lane that completed it

    def finish(self, clock: int) -> None:
        """Completed: let the buffers go."""
        self.tensors = ()
        self.completed_at = clock
        self.done.set()


class Comm:
    """One rank's posted receives and in-flight sends.

    `post_ahead`: how many compute instructions before its consumer the interpreter posts a
    receive (None: all of a step's receives at its start)."""

    def __init__(
        self,
        global_rank: Callable[[int], int],
        n_stages: int,
        m: int,
        timeout: float,
        post_ahead: int | None = 0,
        lanes: bool = False,
    ) -> None:
        self.global_rank = global_rank
        self.post_ahead = post_ahead
        self.n_stages, self.m = n_stages, m
        self.timeout = timedelta(seconds=timeout)
        self.posted: dict[tuple[int, int, int], tuple[int, list, list[Tensor]]] = {}
        self.in_flight: list[Send] = []
        self.clock = 0  # instructions this rank has begun, all steps (the interpreter counts)
        self.waited = 0.0  # seconds spent waiting since the interpreter last read it
        self.waiting_on: tuple[int, Kind, int, int] | None = None  # (src, key) of a blocked wait
        self._lanes: dict[int, queue.Queue[Send]] | None = {} if lanes else None
        self._error: Exception | None = None  # a lane's failure, raised by the next call here
        self._lock = threading.Lock()  # a lane marking a send complete vs the poll

    def _tag(self, kind: Kind, stage: int, mb: int, i: int) -> int:
        return ((kind * self.n_stages + stage) * self.m + mb) * MAX_TENSORS + i

    # -- receives ----------------------------------------------------------------------------

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
        """Wait for a posted receive and return its buffers (this rank's from now on)."""
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

    # -- sends -------------------------------------------------------------------------------

    def send(self, kind: Kind, stage: int, mb: int, peer: int, tensors: Sequence[Tensor]) -> None:
        """Send `tensors` (non-blocking); they are held until the send completes."""
        if len(tensors) > MAX_TENSORS:
            raise RuntimeError(f"{len(tensors)} tensors in one message; at most {MAX_TENSORS}")
        self._raise_error()
        out = Send(
            (kind, stage, mb),
            self.global_rank(peer),
            tuple(t.detach().contiguous() for t in tensors),
            self.clock,
        )
        self.in_flight.append(out)
        if self._lanes is None:
            out.works = self._issue(out)
        else:
            self._lane(out.dst).put(out)

    def _issue(self, out: Send) -> list:
        kind, stage, mb = out.key
        return [
            dist.isend(t, dst=out.dst, tag=self._tag(kind, stage, mb, i))
            for i, t in enumerate(out.tensors)
        ]

    def _lane(self, dst: int) -> queue.Queue[Send]:
        assert self._lanes is not None
        lane = self._lanes.get(dst)
        if lane is None:
            lane = self._lanes[dst] = queue.Queue()
            threading.Thread(
                target=self._lane_loop, args=(lane,), name=f"pipec-send-{dst}", daemon=True
            ).start()
        return lane

    def _lane_loop(self, lane: queue.Queue[Send]) -> None:
        while True:
            out = lane.get()
            try:
                if self._error is None:
                    self._send_and_wait(out)
            except Exception as e:  # noqa: BLE001 - handed to the main thread
                self._error = e
            finally:
                with self._lock:  # the clock it reads is the poll's: none misses it
                    out.finish(self.clock)  # the buffers go now, not at the next poll
                lane.task_done()

    def _send_and_wait(self, out: Send) -> None:
        # Its own frame: a work holds its tensor, and a loop variable outliving the wait
        # would keep the last send's buffer until the lane's next message.
        for w in self._issue(out):
            w.wait(self.timeout)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def poll(self) -> None:
        """Forget completed sends, releasing their buffers (between instructions)."""
        self._raise_error()
        if self._lanes is None:
            for out in self.in_flight:
                if out.completed_at is None and all(w.is_completed() for w in out.works):
                    out.finish(self.clock)
        with self._lock:
            if any(out.completed_at is not None for out in self.in_flight):
                self.in_flight = [out for out in self.in_flight if out.completed_at is None]

    def complete(self, kinds: frozenset[Kind] | None = None) -> None:
        """Wait until the sends in flight (of `kinds`; None: all) have completed; release them."""
        t0 = time.perf_counter()
        for out in self.in_flight:
            if kinds is not None and out.key[0] not in kinds:
                continue
            kind, stage, mb = out.key
            self.waiting_on = (out.dst, kind, stage, mb)
            if self._lanes is None:
                for w in out.works:
                    w.wait(self.timeout)
                out.finish(self.clock)
            else:
                out.done.wait()  # the lane sets it, also when its own wait times out
        self.waiting_on = None
        self.waited += time.perf_counter() - t0
        self.poll()

    def drain(self) -> None:
        """Wait for every send still in flight; a receive left posted is a program error."""
        self.complete()
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
