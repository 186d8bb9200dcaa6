"""The interpreter's own cost per instruction, counted rather than timed (timings on a shared
machine say nothing): the Python calls `run_program` makes around its handlers, and how often
it reads the memory meter, whose CPU reading walks malloc's free lists (tens of microseconds
with cold caches, the bulk of the loop's time when it read after every instruction).

The program is a real one (1F1B, p=2, m=8, both ranks; gloo's receive policy and NCCL's
batched one) with handlers that do nothing, so every call counted is the loop's.
"""

import gc
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipec.build_dir import emit, load
from pipec.compile import compile_schedule
from pipec.ir import Op
from pipec.model import compile_model
from pipec.runtime.faults import Watchdog
from pipec.runtime.interpreter import HANDLERS, QUIET, run_program
from pipec.runtime.meter import FULL_EVERY, Meter
from pipec.runtime.p2p import Comm
from pipec.runtime.rank import Rank
from pipec.runtime.transport import Transport
from tests.helpers import NO_WATCHDOG, stand_in_rank

#: Python-level calls (functions and builtins) per instruction, the handler's own included.
#: The loop makes 5 to 6 (two host-clock readings, the handler, the poll, the meter); it made
#: about 9 while the clock, the watchdog and the waited time were calls, and 20 to 22 while it
#: read the meter after every instruction and worked out its positions every step.
CALLS_PER_INSTRUCTION = 7
STEPS = 3
ROOT = Path(__file__).resolve().parents[1]


class CountingMeter(Meter):
    """The CPU meter, counting its readings."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.reads = 0

    def read(self) -> int:
        self.reads += 1
        return super().read()


def rank(program, protocol: str) -> SimpleNamespace:
    """What `run_program` uses of a Rank: its program, a real Comm, the meter, parameters."""
    params = [nn.Parameter(torch.zeros(8)) for _ in range(4)]
    comm = Comm(lambda r: r, 2, 8, 60.0, transport=Transport(protocol=protocol))
    optimizer = torch.optim.SGD(params, lr=0.1)
    return stand_in_rank(program, comm, CountingMeter(), params=params, optimizer=optimizer)


def nothing(rt, instr) -> None:  # type: ignore[no-untyped-def]
    """A handler that does no work: what is left is the interpreter's."""


CASES = [(r, protocol) for r in (0, 1) for protocol in ("gloo", "nccl")]


@pytest.fixture(scope="module")
def programs():
    return compile_schedule("1f1b", 2, 8).compiled.programs


def count_calls(rt, steps: int) -> int:
    """Python calls and builtin calls made while `steps` steps run."""
    calls = 0

    def profile(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    handlers = dict.fromkeys(HANDLERS, nothing)
    sys.setprofile(profile)
    try:
        for _ in range(steps):
            run_program(rt, handlers, NO_WATCHDOG)
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("r,protocol", CASES)
def test_python_calls_per_instruction_stay_bounded(programs, r, protocol):
    program = programs[r]
    rt = rank(program, protocol)
    count_calls(rt, 1)  # the first step makes the meter and the rank's positions
    calls = count_calls(rt, STEPS)
    per_instruction = calls / (STEPS * len(program))
    assert per_instruction <= CALLS_PER_INSTRUCTION, (
        f"rank {r} ({protocol}): {per_instruction:.1f} Python calls per instruction around the "
        f"handlers, bound {CALLS_PER_INSTRUCTION}: the interpreter's loop grew"
    )


@pytest.mark.parametrize("r,protocol", CASES)
def test_the_meter_reads_only_where_the_bytes_can_rise(programs, r, protocol):
    """One reading per instruction that can raise the bytes: every forward, where receives
    are posted, the optimizer, the first BW of a stage in the step; none after a send, a
    receive posted ahead or a later BW (which only let bytes go). The positions of a step are
    worked out once per rank, not once per step."""
    program = programs[r]
    rt = rank(program, protocol)
    trace = run_program(rt, dict.fromkeys(HANDLERS, nothing), NO_WATCHDOG, full=True)
    positions = rt.positions
    for _ in range(STEPS - 1):
        run_program(rt, dict.fromkeys(HANDLERS, nothing), NO_WATCHDOG, full=True)
    assert rt.positions is positions
    read = positions.metered
    assert rt.meter.reads == STEPS * sum(read)
    for k, instr in enumerate(program):
        if k in positions.posts or instr.op in (Op.F, Op.OPTIMIZER_STEP):
            assert read[k], f"{instr} at {k} not read"
        elif instr.op in QUIET or k in positions.ahead:
            assert not read[k], f"{instr} at {k} read"
    for stage in {i.stage for i in program if i.op is Op.BW}:
        bws = [k for k, i in enumerate(program) if i.op is Op.BW and i.stage == stage]
        assert [read[k] for k in bws] == [True] + [False] * (len(bws) - 1)
    if protocol == "gloo":  # every receive posted before instruction 0: read there, then at
        # the forwards, one BW and the optimizer
        forwards = sum(i.op is Op.F for i in program)
        assert sum(read) == (program[0].op is not Op.F) + forwards + 2
    for k in range(1, len(program)):  # a reading stands for the instructions up to the next
        if not read[k]:
            assert trace.real[k] == trace.real[k - 1]


def test_between_full_steps_the_meter_reads_where_they_peaked(programs):
    """Steps 1, 2, every FULL_EVERY-th and any asked `full` read at every metered position;
    the others only after the instruction where the last full step peaked, and find the
    same peak: here each forward holds 256 KiB until its micro-batch's backward, so the peak
    comes after the last warm-up forward."""
    program = programs[0]
    rt = rank(program, "gloo")
    held: dict[int, torch.Tensor] = {}

    def forward(rt, instr) -> None:  # type: ignore[no-untyped-def]
        held[instr.mb] = torch.ones(1 << 16)

    def backward(rt, instr) -> None:  # type: ignore[no-untyped-def]
        del held[instr.mb]

    handlers = dict.fromkeys(HANDLERS, nothing) | {Op.F: forward, Op.BW: backward}
    reads, traces = [], []
    gc.collect()  # earlier tests' garbage, freed by a collection mid-step, would lower readings
    for step in range(1, 2 * FULL_EVERY + 2):
        before = rt.meter.reads
        traces.append(run_program(rt, handlers, NO_WATCHDOG, full=step == 2 * FULL_EVERY + 1))
        reads.append(rt.meter.reads - before)
    metered = sum(rt.positions.metered)
    full = [s for s in range(1, len(reads) + 1) if reads[s - 1] == metered]
    assert full == [1, 2, FULL_EVERY, 2 * FULL_EVERY, 2 * FULL_EVERY + 1]
    assert [t.full for t in traces] == [s in full for s in range(1, len(reads) + 1)]
    assert all(n == 1 for s, n in enumerate(reads, 1) if s not in full)
    first_peak = traces[1].real_peak
    assert first_peak >= 2 * (1 << 18)  # p=2 warm-up forwards of rank 0, each 256 KiB
    for t in traces[2:]:
        assert abs(t.real_peak - first_peak) <= 16 << 10, "a sparse step missed the peak"


def host_reads_per_step(tmp_path, m: int) -> int:
    """`.item()` and `.tolist()` calls in one training step of a real two-stage build on one
    rank (interleaved at p=1: the first stage hands its output over locally), the second step
    (the first counts the stashes under hooks)."""
    out = tmp_path / f"m{m}"
    emit(compile_model(f"{ROOT}/tests/train_factories.py:copying", "interleaved", 1, m), out)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    reads = 0

    def profile(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        nonlocal reads
        if event == "c_call" and getattr(arg, "__name__", "") in ("item", "tolist"):
            reads += 1

    try:
        rt = Rank.prepare(load(out), 0, 1, torch.device("cpu"))
        rt.connect(lambda ps: torch.optim.SGD(ps, lr=0.1), 30)
        with Watchdog(30, rt.describe) as watchdog:
            for step in (1, 2):
                rt.new_step(step)
                sys.setprofile(profile if step == 2 else None)
                try:
                    run_program(rt, HANDLERS, watchdog)
                finally:
                    sys.setprofile(None)
                assert len(rt.step_state.losses) == m
    finally:
        dist.destroy_process_group()
    return reads


def test_a_step_reads_no_device_value_per_micro_batch(tmp_path):
    """The losses stay on the device until the step's figures are gathered: on CUDA every
    `.item()` makes the host wait for the GPU, so one per micro-batch kept the host from
    queueing the next instruction's kernels while a last-stage F ran. A step of 4 micro-batches
    reads no more device values than one of 2."""
    assert host_reads_per_step(tmp_path, 4) == host_reads_per_step(tmp_path, 2)
