"""Instruction timing (runtime/clock.py): on CUDA an instruction's time is when the GPU ran it,
not when its kernels were launched; on CPU the host times are kept as they are.

Without a GPU, `CudaClock` runs against a stand-in stream: a handler queues GPU work and
returns at once, the work runs after what was queued before it, and an event fires when the
stream reaches it. The interpreter's loop (`run_program`) is the code under test. The host's
time is virtual too (`VirtualTime`), so what the tests assert does not depend on this
machine's load.
"""

import time
from types import SimpleNamespace

import pytest
import torch

from pipec.ir import Instr, Op
from pipec.runtime import clock
from pipec.runtime.interpreter import run_program
from tests.helpers import NO_WATCHDOG, stand_in_rank

WORK_S = 0.05  # GPU seconds each instruction queues: far above a handler's own host time
TICK_S = 1e-6  # host seconds that pass at each reading of the clock


class VirtualTime:
    """`time.perf_counter` and `time.sleep` for the code under test: time passes by TICK_S
    at each reading, and by what a sleep asks for."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += TICK_S
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@pytest.fixture
def virtual_time(monkeypatch: pytest.MonkeyPatch) -> VirtualTime:
    clock_ = VirtualTime()
    monkeypatch.setattr(time, "perf_counter", clock_.perf_counter)
    monkeypatch.setattr(time, "sleep", clock_.sleep)
    return clock_


class FakeStream:
    """One CUDA stream on the host's time axis: `busy_until` is when its queue drains."""

    def __init__(self) -> None:
        self.busy_until = 0.0

    def launch(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, time.perf_counter()) + seconds

    def synchronize(self, device: torch.device) -> None:
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    """torch.cuda.Event's record/elapsed_time: fires when the stream reaches it."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.at = stream, 0.0

    def record(self) -> None:
        self.at = max(self.stream.busy_until, time.perf_counter())

    def elapsed_time(self, later: "FakeEvent") -> float:
        return (later.at - self.at) * 1e3


def run_step(device: str, stream: FakeStream, n: int = 3):
    """One step of `n` instructions, each queueing WORK_S of GPU work and returning."""
    program = tuple(Instr(Op.F, 0, mb) for mb in range(n))
    comm = SimpleNamespace(
        post_ahead=0, batched=False, waited=0.0, poll=lambda: None, clock=0, in_flight=[]
    )
    meter = SimpleNamespace(
        start_step=lambda state: None,
        model_state=lambda params, optimizer: 0,
        read=lambda: 0,
        step_peak=max,
    )
    rt = stand_in_rank(program, comm, meter, device)
    return run_program(rt, {Op.F: lambda rt, instr: stream.launch(WORK_S)}, NO_WATCHDOG)


@pytest.mark.usefixtures("virtual_time")
def test_on_cuda_an_instruction_lasts_as_long_as_its_gpu_work(monkeypatch: pytest.MonkeyPatch):
    stream = FakeStream()
    monkeypatch.setattr(
        clock,
        "clock_for",
        lambda device, n: clock.CudaClock(device, n, stream.event, stream.synchronize),
    )
    trace = run_step("cuda", stream)
    durations = [e - s for s, e in zip(trace.start, trace.end)]
    # The first waits for nothing; later ones start when the GPU finished the one before.
    assert WORK_S <= durations[0] <= WORK_S + 100 * TICK_S
    assert durations[1:] == pytest.approx([WORK_S] * 2, abs=1e-6)
    assert trace.start[1:] == pytest.approx(trace.end[:-1], abs=1e-6)
    assert trace.wall_s >= 3 * WORK_S  # the step ends when the GPU is done
    assert trace.handler_s < WORK_S  # the handlers' own host time: launches


@pytest.mark.usefixtures("virtual_time")
def test_on_cpu_the_host_times_are_kept(monkeypatch: pytest.MonkeyPatch):
    """The same handlers timed by the host clock: each instruction lasts its launch, which is
    what the CPU runtime must keep measuring (there a handler's return ends its work)."""
    stream = FakeStream()
    trace = run_step("cpu", stream)
    assert isinstance(clock.clock_for(torch.device("cpu"), 3), clock.HostClock)
    durations = [e - s for s, e in zip(trace.start, trace.end)]
    assert max(durations) < WORK_S
    assert trace.handler_s == pytest.approx(sum(durations))


@pytest.mark.usefixtures("virtual_time")
def test_a_host_wait_delays_the_start():
    """An instruction whose handler first waited for an input (the host's start is after the
    wait) starts no earlier than that, even when the GPU reached its start event before."""
    stream = FakeStream()
    timer = clock.CudaClock(torch.device("cuda"), 1, stream.event, stream.synchronize)
    begin = timer.begin()
    t0 = time.perf_counter()
    timer.start(0)
    waited = 0.02
    time.sleep(waited)  # the receive
    stream.launch(WORK_S)
    t1 = time.perf_counter()
    timer.end(0)
    (start,), (end,) = timer.finish(begin, [t0 + waited], [t1])
    assert start == t0 + waited
    assert end >= start + WORK_S - 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_events_time_the_kernel_not_its_launch():
    """A 20 ms GPU spin timed by CudaClock lasts about 20 ms; its launch takes microseconds."""
    device = torch.device("cuda")
    torch.cuda._sleep(1000)  # load the kernel
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(10**7)
    torch.cuda.synchronize()
    spin_s = time.perf_counter() - t
    timer = clock.CudaClock(device, 1)
    begin = timer.begin()
    t0 = time.perf_counter()
    timer.start(0)
    torch.cuda._sleep(10**7)
    t1 = time.perf_counter()
    timer.end(0)
    (start,), (end,) = timer.finish(begin, [t0], [t1])
    assert t1 - t0 < spin_s / 10
    assert end - start == pytest.approx(spin_s, rel=0.3)
