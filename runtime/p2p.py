"""Point-to-point messages: one place where a send or receive is issued and completed.

A message is keyed (kind, producer stage, mb): the activation F(s, mb) sends on, the input
gradient B(s, mb) sends back, or a BPipe stash going out (STASH) or coming back (STASH_BACK).
Every size is known from the plan on both sides (stage boundaries from the model's facts, a
stash's flat buffer from its measured bytes), so no message ever carries a size and no receive
waits on the host for one.

Receives: `post` allocates the buffers and issues a non-blocking receive; `take` waits for it
and hands the buffers over (the consuming instruction; the time it waits is not busy time).
Where the interpreter posts them is the transport's policy (`passes.memory_bytes.POST_AHEAD`).

Sends: `send` issues a non-blocking send and keeps its tensors in `in_flight` only until it
completes; `poll`, which the interpreter calls after every instruction, lets completed ones go,
so a sent buffer lives from its send to the first instruction boundary after it arrived, never
to the end of the step. `drain` (the optimizer step) only waits for what is still in flight.

How messages travel is the `Transport`:
- gloo matches messages by tag, each direction between two ranks in its own group (`links`,
  made by `Rank.connect`): gloo's TCP pair locks for a send while its I/O thread reads a
  message coming the other way, so over one shared pair 7-18% of `isend`s held their caller
  1-12 ms while both ranks computed; with a pair per direction 0.1-3% did, p99 0.3 ms
  (`bench/gloo_pairs.py`, docs/runtime.md). Its send work reports completion only once waited,
  so each destination has a lane: a thread that waits for that destination's sends in program
  order and drops each one's tensors the moment it completes. The send instruction issues the
  `isend` itself (on gloo every receive of a step is posted at its start, so the receiver is
  ready): issued from the lane, a message also waited for the lane thread's wake-up and the
  GIL. On the tiny GPT, 1F1B, 2 ranks on 2 cores, a message arrived a median 0.41-0.50 ms
  after its send through the lane, with 2.5-4 ms outliers in about one wait in five, and
  0.17-0.22 ms issued by the instruction (docs/runtime.md). The `isend` costs its caller
  0.1-0.2 ms.
- NCCL matches messages in issue order per pair of ranks and direction, and has no tags. Every
  message goes through `batch_isend_irecv`, one batch per `passes.batches.message_batches`
  entry (the interpreter calls `flush` at each batch's end), so all of them share the group's
  communicator and its order, and a send and a receive of one batch progress together. `poll`
  asks each work whether it completed. On CUDA messages are issued from their own stream,
  ordered against compute by events (runtime/transport.py). The same protocol runs over gloo
  (no tags, so matched in order too), which is how the CPU tests exercise it.
- Staged (gloo with tensors on a GPU, which gloo cannot carry): a send copies its tensors to
  host buffers (page-locked, asynchronously; its lane waits for the copy) and keeps the device
  tensors until it completes, as an NCCL send would; a receive lands in host buffers and is
  copied into its device buffers when taken.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from pipec.ir import MAX_TENSORS, Instr, Op
from pipec.passes.memory_bytes import post_ahead
from pipec.runtime.transport import CommStream, Staging, Transport

if TYPE_CHECKING:
    from pipec.runtime.rank import Rank

SENDS = frozenset({Op.SEND_ACT, Op.SEND_GRAD, Op.EVICT, Op.RETURN})  # instructions that send
Spec = tuple[tuple[int, ...], torch.dtype]  # a receive buffer: shape and dtype


class Kind(enum.IntEnum):
    ACT = 0
    GRAD = 1
    STASH = 2
    STASH_BACK = 3


class Send:
    """One message in flight: `tensors` (what was sent, and its host copies when staged) are
    referenced until the send completes; `wire` is what goes on the wire.

    `completed_at` is the sender's instruction clock (`Comm.clock`) when its completion was
    seen."""

    __slots__ = ("completed_at", "dst", "key", "tensors", "wire", "works", "written")

    def __init__(
        self,
        key: tuple[Kind, int, int],
        dst: int,
        tensors: tuple[Tensor, ...],
        wire: tuple[Tensor, ...],
        written: torch.cuda.Event | None = None,
    ) -> None:
        self.key, self.dst, self.tensors, self.wire = key, dst, tensors, wire
        self.written = written  # staged on CUDA: the copy to host memory is done
        self.works: list = []
        self.completed_at: int | None = None

    def finish(self, clock: int) -> None:
        """Completed: let the buffers go (its works hold them too)."""
        self.tensors = self.wire = ()
        self.works = []
        self.written = None
        self.completed_at = clock


class Posted:
    """A posted receive: `buffers` are the consumer's, `wire` what the transfer writes (the
    buffers, or their host twins when staged), `works` its works once issued."""

    __slots__ = ("buffers", "src", "wire", "works")

    def __init__(self, src: int, buffers: list[Tensor], wire: list[Tensor]) -> None:
        self.src, self.buffers, self.wire = src, buffers, wire
        self.works: list = []


class Links(NamedTuple):
    """The groups a rank's messages travel in, by the peer's global rank: one per direction
    between two ranks (see the module's docstring); a peer missing uses the world's."""

    send: dict[int, dist.ProcessGroup]  # destination -> the group of this rank's sends
    recv: dict[int, dist.ProcessGroup]  # source -> the group of its messages here


class Comm:
    """One rank's posted receives and in-flight sends.

    `post_ahead`: how many compute instructions before its consumer the interpreter posts a
    receive (None: all of a step's receives at its start). `stream`: the comm stream of an
    NCCL run on CUDA (made here unless given; tests pass a stand-in). `links`: the groups gloo's
    messages travel in (default: the world's)."""

    def __init__(
        self,
        global_rank: Callable[[int], int],
        n_stages: int,
        m: int,
        timeout: float,
        device: torch.device | None = None,
        transport: Transport | None = None,
        stream: CommStream | None = None,
        links: Links | None = None,
    ) -> None:
        self.global_rank = global_rank
        self.links = links or Links({}, {})
        self.device = device or torch.device("cpu")
        transport = transport or Transport()
        self.batched = transport.protocol == "nccl"
        self.post_ahead = post_ahead(transport.protocol)
        self.staging = Staging(transport.pinned) if transport.staged else None
        if stream is None and self.batched and self.device.type == "cuda":
            stream = CommStream(self.device)
        self.stream = stream
        self.n_stages, self.m = n_stages, m
        self.timeout = timedelta(seconds=timeout)
        self.posted: dict[tuple[int, int, int], Posted] = {}
        self.in_flight: list[Send] = []
        self.clock = 0  # instructions this rank has begun, all steps (the interpreter counts)
        self.waited = 0.0  # seconds spent waiting since the interpreter last read it
        self.waiting_on: tuple[int, Kind, int, int] | None = None  # (src, key) of a blocked wait
        self._batch: list[tuple] = []  # the open batch: (op, tensor, peer, tag, works to fill)
        # gloo's: a sending thread per peer. A SimpleQueue and one condition for all sends (not
        # a Queue and an Event per send): a send's Python cost is on the critical path.
        self._lanes: dict[int, queue.SimpleQueue[Send]] = {}
        self._error: Exception | None = None  # a lane's failure, raised by the next call here
        self._lock = threading.Condition()  # a lane marking a send complete vs poll, complete
        self.finished = self._swept = 0  # sends the lanes finished; of them, swept by poll

    def _tag(self, kind: Kind, stage: int, mb: int, i: int) -> int:
        if self.batched:
            return 0  # matched in issue order, as NCCL does (which ignores tags)
        return ((kind * self.n_stages + stage) * self.m + mb) * MAX_TENSORS + i

    def _issuing(self, sends: bool) -> AbstractContextManager:
        return self.stream.issuing(sends) if self.stream is not None else nullcontext()

    def _submit(
        self, op: Callable, tensors: Sequence[Tensor], peer: int, key: tuple, works: list
    ) -> None:
        """Issue one message's tensors now, or add them to the open batch (NCCL)."""
        tags = [self._tag(*key, i) for i in range(len(tensors))]
        if self.batched:
            self._batch += [(op, t, peer, tag, works) for t, tag in zip(tensors, tags)]
        else:
            group = (self.links.send if op is dist.isend else self.links.recv).get(peer)
            works.extend(op(t, peer, group=group, tag=tag) for t, tag in zip(tensors, tags))

    def flush(self) -> None:
        """Issue the open batch as one `batch_isend_irecv` (a batch ends; see passes/batches)."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        ops = [dist.P2POp(op, t, peer, tag=tag) for op, t, peer, tag, _ in batch]
        with self._issuing(sends=any(op is dist.isend for op, *_ in batch)):
            works = dist.batch_isend_irecv(ops)
        owners = [entry[-1] for entry in batch]
        if len(works) == len(batch):  # a work per tensor (gloo does not coalesce)
            for owner, w in zip(owners, works):
                owner.append(w)
        else:  # one work for the whole batch (NCCL)
            for owner in {id(owner): owner for owner in owners}.values():
                owner.extend(works)

    # -- receives ----------------------------------------------------------------------------

    def post(self, kind: Kind, stage: int, mb: int, peer: int, specs: Sequence[Spec]) -> None:
        """Allocate the buffers of a message and issue its receive."""
        key = (kind, stage, mb)
        if key in self.posted:
            raise RuntimeError(f"{kind.name} s={stage} mb={mb} received twice")
        with self._issuing(sends=False):  # on CUDA the buffers belong to the comm stream
            buffers = [
                torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs
            ]
        wire = self.staging.host(buffers) if self.staging else buffers
        entry = self.posted[key] = Posted(self.global_rank(peer), buffers, wire)
        self._submit(dist.irecv, wire, entry.src, key, entry.works)

    def take(self, kind: Kind, stage: int, mb: int) -> tuple[Tensor, ...]:
        """Wait for a posted receive and return its buffers (this rank's from now on). On CUDA
        with NCCL the compute stream waits, not the host (runtime/transport.py)."""
        try:
            entry = self.posted.pop((kind, stage, mb))
        except KeyError:
            raise RuntimeError(
                f"needs {kind.name} of stage {stage} mb {mb}, but no receive was posted for it"
            ) from None
        if entry.wire and not entry.works:  # still in the open batch: issue it first
            self.flush()
        if self.stream is not None:
            self.stream.consume(entry.works, entry.buffers)
            return tuple(entry.buffers)
        self.waiting_on = (entry.src, kind, stage, mb)
        t0 = time.perf_counter()
        for w in entry.works:
            w.wait(self.timeout)
        self.waited += time.perf_counter() - t0
        self.waiting_on = None
        if self.staging:
            self.staging.into(entry.buffers, entry.wire)
        return tuple(entry.buffers)

    # -- sends -------------------------------------------------------------------------------

    def send(self, kind: Kind, stage: int, mb: int, peer: int, tensors: Sequence[Tensor]) -> None:
        """Send `tensors` (non-blocking); they are held until the send completes."""
        if len(tensors) > MAX_TENSORS:
            raise RuntimeError(f"{len(tensors)} tensors in one message; at most {MAX_TENSORS}")
        self._raise_error()
        held = tuple(t.detach().contiguous() for t in tensors)
        key, dst = (kind, stage, mb), self.global_rank(peer)
        if self.staging is None:
            out = Send(key, dst, held, held)
        else:
            host, written = self.staging.out(held)
            out = Send(key, dst, held + tuple(host), tuple(host), written)
        self.in_flight.append(out)
        if self.batched:
            self._submit(dist.isend, out.wire, dst, key, out.works)
            return
        if self.staging is None:  # the receive is posted: issued now (staged: by the lane)
            self._submit(dist.isend, out.wire, dst, key, out.works)
        self._lane(dst).put(out)  # it waits for the send

    def _lane(self, dst: int) -> queue.SimpleQueue[Send]:
        lane = self._lanes.get(dst)
        if lane is None:
            lane = self._lanes[dst] = queue.SimpleQueue()
            threading.Thread(
                target=self._lane_loop, args=(lane,), name=f"pipec-send-{dst}", daemon=True
            ).start()
        return lane

    def _lane_loop(self, lane: queue.SimpleQueue[Send]) -> None:
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
                    self.finished += 1
                    self._lock.notify_all()  # a `complete` waiting for it

    def _send_and_wait(self, out: Send) -> None:
        # Its own frame: a work holds its tensor, and a loop variable outliving the wait
        # would keep the last send's buffer until the lane's next message.
        if self.staging is not None:  # staged: issued here, once the copy to host is done
            if out.written is not None:
                out.written.synchronize()
            self._submit(dist.isend, out.wire, out.dst, out.key, out.works)
        for w in out.works:
            w.wait(self.timeout)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def poll(self) -> None:
        """Forget completed sends, releasing their buffers (between instructions)."""
        if self._error is not None:
            raise self._error
        if not self.in_flight:
            return
        if self.batched:
            for out in self.in_flight:
                issued = out.works or not out.wire  # a send in the open batch has no work yet
                if out.completed_at is None and issued and all(w.is_completed() for w in out.works):
                    out.finish(self.clock)
            done = any(out.completed_at is not None for out in self.in_flight)
        else:
            done = self.finished != self._swept  # a lane finished one since the last sweep
        if done:
            with self._lock:
                self._swept = self.finished
                self.in_flight = [out for out in self.in_flight if out.completed_at is None]

    def complete(self, kinds: frozenset[Kind] | None = None) -> None:
        """Wait until the sends in flight (of `kinds`; None: all) have completed; release them."""
        self.flush()  # a send still in the open batch would never complete
        t0 = time.perf_counter()
        for out in self.in_flight:
            if kinds is not None and out.key[0] not in kinds:
                continue
            kind, stage, mb = out.key
            self.waiting_on = (out.dst, kind, stage, mb)
            if self.batched:
                for w in out.works:
                    w.wait(self.timeout)
                out.finish(self.clock)
            else:
                self.wait_finished(out)  # the lane finishes it, also when its own wait times out
        self.waiting_on = None
        self.waited += time.perf_counter() - t0
        self.poll()

    def wait_finished(self, out: Send, timeout: float | None = None) -> bool:
        """Wait until a lane has finished `out` (gloo); False if `timeout` seconds passed."""
        with self._lock:
            return self._lock.wait_for(lambda: out.completed_at is not None, timeout)

    def drain(self) -> None:
        """Wait for every send still in flight; a receive left posted is a program error."""
        self.complete()
        if self.posted:
            kind, stage, mb = next(iter(self.posted))
            raise RuntimeError(
                f"{len(self.posted)} receives never consumed, e.g. {Kind(kind).name} s={stage} "
                f"mb={mb}"
            )


def recv_act(rt: Rank, instr: Instr) -> None:
    """Post the receive of stage s's input activation, produced by the previous stage."""
    prev = rt.layout.prev_stage(instr.stage)
    rt.comm.post(Kind.ACT, prev, instr.mb, instr.peer, rt.boundary(instr.stage, "inputs"))


def recv_grad(rt: Rank, instr: Instr) -> None:
    """Post the receive of the gradient of stage s's output, produced by the next stage."""
    nxt = rt.layout.next_stage(instr.stage)
    rt.comm.post(Kind.GRAD, nxt, instr.mb, instr.peer, rt.boundary(instr.stage, "outputs"))


def send_act(rt: Rank, instr: Instr) -> None:
    """Send F(s, mb)'s output on (non-blocking)."""
    tensors = rt.step_state.outbox.pop((Kind.ACT, instr.stage, instr.mb))
    rt.comm.send(Kind.ACT, instr.stage, instr.mb, instr.peer, tensors)


def send_grad(rt: Rank, instr: Instr) -> None:
    """Send B(s, mb)'s input gradient back (non-blocking)."""
    tensors = rt.step_state.outbox.pop((Kind.GRAD, instr.stage, instr.mb))
    rt.comm.send(Kind.GRAD, instr.stage, instr.mb, instr.peer, tensors)
