"""What differs between the transports of runtime/p2p.py's `Comm`: which one a run uses, the
host staging of gloo on a GPU, and NCCL's comm stream.

`Transport.for_run` picks it: NCCL with CUDA; gloo on CPU; gloo with tensors on a GPU
(`launch.py --share-gpu`) stages every message through page-locked host memory (`Staging`).

NCCL's messages run on a CUDA stream of their own, ordered against compute by events
(`CommStream`). On CUDA a handler returns once its kernels are queued on the compute stream
(the current one). ProcessGroupNCCL runs each transfer on its internal stream after making that
stream wait for the stream current at the call: issued from the compute stream, a receive could
not start before all the compute queued ahead of it had finished, though it needs none of it.
So an NCCL run issues its messages from a stream of their own, `comm`, and orders the two by
events:

- a batch that sends first makes `comm` wait for the compute stream (`wait_stream`: an event
  recorded on compute, waited for on comm): a send starts once the compute that produced it
  is done, and no later than that;
- a batch of receives waits for nothing on the compute stream; the receive buffers are
  allocated while `comm` is current, so the caching allocator gives them memory that comm's
  own earlier work has released;
- the consumer of a receive makes the compute stream wait for its transfer (a work's `wait()`
  without a timeout: the current stream waits, the host does not) and records the buffers'
  use on the compute stream (`record_stream`): their memory is not handed out again until the
  compute queued to read them has run.

Sent tensors were allocated on the compute stream; ProcessGroupNCCL records its own stream's
use of every tensor it sends or receives, so dropping one before its transfer ends is safe.
Without CUDA (and for gloo, whose transfers are host work) a Comm has no stream: every method
here is skipped and a receive is waited for on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Transport:
    """How a rank's messages travel (runtime/p2p.py's docstring): `protocol` "gloo" or "nccl"
    (also the receive policy's name in `POST_AHEAD`); `staged` through host buffers,
    page-locked when `pinned`. `for_run` picks it; tests force one."""

    protocol: str = "gloo"
    staged: bool = False
    pinned: bool = False

    @staticmethod
    def for_run(backend: str, device: torch.device) -> Transport:
        if backend == "nccl":
            return Transport("nccl")
        cuda = device.type == "cuda"  # several ranks sharing a GPU over gloo
        return Transport("gloo", staged=cuda, pinned=cuda)


class Staging:
    """Device tensors through host memory. Page-locked buffers make both copies asynchronous:
    a send's lane waits for its copy's event; a received buffer's copy is queued on the compute
    stream ahead of its consumer (the host allocator keeps the page-locked buffer until then)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned

    def host(self, like: Sequence[Tensor]) -> list[Tensor]:
        return [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned) for t in like]

    def out(self, tensors: Sequence[Tensor]) -> tuple[list[Tensor], torch.cuda.Event | None]:
        """Host copies of `tensors`, and the event that says they are written (None: already)."""
        host = self.host(tensors)
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=self.pinned)
        if not self.pinned:
            return host, None
        written = torch.cuda.Event()
        written.record()
        return host, written

    def into(self, buffers: Sequence[Tensor], host: Sequence[Tensor]) -> None:
        for b, h in zip(buffers, host):
            b.copy_(h, non_blocking=self.pinned)


class CommStream:
    """The comm stream of one rank and the compute stream it is ordered against.

    `comm`, `compute`, `use` (make a stream current) and `record` (a tensor's use on a stream)
    are torch.cuda's by default; tests pass stand-ins."""

    def __init__(
        self,
        device: torch.device,
        comm: torch.cuda.Stream | None = None,
        compute: torch.cuda.Stream | None = None,
        use: Callable[[torch.cuda.Stream], AbstractContextManager] | None = None,
        record: Callable[[Tensor, torch.cuda.Stream], None] | None = None,
    ) -> None:
        self.comm = comm or torch.cuda.Stream(device)
        self.compute = compute or torch.cuda.current_stream(device)
        self._use = use or torch.cuda.stream
        self._record = record or Tensor.record_stream

    def issuing(self, sends: bool) -> AbstractContextManager:
        """Make `comm` current for allocating receive buffers or issuing a batch; a batch that
        `sends` first waits for the compute queued so far (it produced what is sent)."""
        if sends:
            self.comm.wait_stream(self.compute)
        return self._use(self.comm)

    def consume(self, works: Sequence, buffers: Sequence[Tensor]) -> None:
        """The compute stream waits for a receive's transfer; its buffers are read there."""
        for w in works:
            w.wait()  # no timeout: a stream wait (with one, NCCL would block the host)
        for b in buffers:
            self._record(b, self.compute)
