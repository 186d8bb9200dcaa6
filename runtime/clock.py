"""Instruction clocks: when each instruction of a step ran, on the device that ran it.

The interpreter reads the host's time (`time.perf_counter`) when each instruction starts and
ends; a clock that `marks` also records each start and end (`start(k)`, `end(k)`). The clock
gives the step's beginning and turns the host times into the instructions' times at its end:

    clock = clock_for(rt.device, len(program))
    t_begin = clock.begin()
    t0 = perf_counter(); clock.start(k) if clock.marks; handler(...)
    t1 = perf_counter(); clock.end(k) if clock.marks
    start, end = clock.finish(t_begin, start, end)

(On CPU nothing is called between the host's readings: the loop's calls cost microseconds each
with the caches the compute left cold.)

On CPU a handler's work is done when it returns, so host time (`time.perf_counter`) is the
truth and `HostClock` returns it unchanged. On CUDA a handler returns as soon as its kernels are
queued: host times would be launch times, and the op times, busy time and bubble computed from
them would describe the Python loop, not the GPU. `CudaClock` therefore records a CUDA event on
the current stream at every start and end, and at the end of the step (one synchronize) reads
when the GPU reached each event. The trace's times stay in seconds of `perf_counter` on the
host's axis: the step begins with the GPU idle (a synchronize), so the origin event fires as the
host reads t_begin, and a device time is t_begin + the event's offset from the origin.

The cost on CUDA: two `cudaEventRecord`s per instruction (a few microseconds of host time each,
no synchronisation) and one `torch.cuda.synchronize` at each end of the step; nothing waits for
the GPU between instructions, so the overlap of compute and communication is measured, not
removed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch


class HostClock:
    """Host time: the clock of the CPU runtime, where a handler's return ends its work."""

    marks = False

    def begin(self) -> float:
        return time.perf_counter()

    def finish(
        self, begin: float, start: Sequence[float], end: Sequence[float]
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The host's start and end times, unchanged."""
        return tuple(start), tuple(end)


class CudaClock:
    """Device time from CUDA events on the current stream, on the host's time axis.

    `event` and `synchronize` are torch.cuda's (tests pass stand-ins). The events are created
    once for a program of `n` instructions and recorded again every step.
    """

    def __init__(
        self,
        device: torch.device,
        n: int,
        event: Callable[[], torch.cuda.Event] | None = None,
        synchronize: Callable[[torch.device], None] | None = None,
    ) -> None:
        make = event or functools.partial(torch.cuda.Event, enable_timing=True)
        self.device = device
        self.synchronize = synchronize or torch.cuda.synchronize
        self.origin = make()
        self.starts = [make() for _ in range(n)]
        self.ends = [make() for _ in range(n)]

    def begin(self) -> float:
        self.synchronize(self.device)  # the GPU idle: the origin fires when it is recorded
        self.origin.record()
        return time.perf_counter()

    marks = True

    def start(self, k: int) -> None:
        self.starts[k].record()

    def end(self, k: int) -> None:
        self.ends[k].record()

    def finish(
        self, begin: float, start: Sequence[float], end: Sequence[float]
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Each instruction's (start, end) on the GPU, as host seconds.

        The start is the later of the GPU reaching the start event (its queue finished what came
        before) and the host's start (`start[k]`, after any wait for an input: no kernel of the
        instruction was queued before it). The end is when the GPU reached the end event, not
        before that start.
        """
        self.synchronize(self.device)
        origin = self.origin
        dev_start = [
            max(s, begin + origin.elapsed_time(e) / 1e3) for s, e in zip(start, self.starts)
        ]
        dev_end = [
            max(s, begin + origin.elapsed_time(e) / 1e3) for s, e in zip(dev_start, self.ends)
        ]
        return tuple(dev_start), tuple(dev_end)


Clock = HostClock | CudaClock

_HOST = HostClock()


@functools.cache
def _cuda_clock(device: torch.device, n: int) -> CudaClock:
    return CudaClock(device, n)


def clock_for(device: torch.device, n: int) -> Clock:
    """The clock of a rank whose program of `n` instructions runs on `device`."""
    return _cuda_clock(device, n) if device.type == "cuda" else _HOST
