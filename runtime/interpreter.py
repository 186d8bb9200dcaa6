"""The interpreter: execute one rank's program in order through a dispatch table.

    for k, instr in enumerate(program):
        HANDLERS[instr.op](rank, instr)

plus what makes it measurable and safe: each instruction's start (after any wait for its
input) and end; before one that allocates stash bytes, the stash moves out complete
(`offload.settle`); after it, the sends that completed are let go (`Comm.poll`) and the memory is
read: the stash counter and the meter's real bytes (runtime/meter.py); the watchdog is told
where the rank is. On NCCL the messages of a batch (passes/batches.py) are issued together by
its last instruction (`Comm.flush`). The interpreter never reorders compute or sends; what
overlaps is what the program issued before (sends, all-reduces) and the receives it posts ahead
of their consumers (`post_points`). An op without a handler is refused before the run starts,
naming the op and its line; an instruction that raises leaves the watchdog pointing at it, so
the entry point's report names it and its line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import sub

from torch import nn

from pipec.ir import Instr, Op, PipecError
from pipec.passes.batches import batch_ends
from pipec.passes.memory_bytes import ALLOCATES, post_points
from pipec.runtime import clock, compute, grads, offload, p2p
from pipec.runtime.faults import Watchdog
from pipec.runtime.meter import Sampling
from pipec.runtime.precision import grad_of
from pipec.runtime.rank import FIRST_INSTR_LINE, Rank
from pipec.runtime.stash import tensors_nbytes

Handler = Callable[[Rank, Instr], None]

#: Ops that allocate nothing the meter sees: sends and RETURN only let buffers go (at the poll
#: after them), OVERLAP runs nothing. The meter does not read after them (`Positions`).
QUIET = frozenset({Op.SEND_ACT, Op.SEND_GRAD, Op.RETURN, Op.OVERLAP})

#: Backward ops that raise the bytes only the first time in a step for their stage: the first
#: allocates the stage's weight gradients (zeroed to None by the step before), a later one
#: adds into them in place. A fused BW frees its stash, its inputs and the gradients it
#: received, and allocates only its input gradients (the size of the inputs it frees); W
#: frees what B left for it. B is not here: what it leaves for W can outweigh what it frees.
FIRST_ONLY = frozenset({Op.BW, Op.W})


def meter_points(program: Sequence[Instr], posts: Mapping[int, Sequence[int]]) -> tuple[bool, ...]:
    """After which instructions the meter reads: where the bytes can rise above every earlier
    reading. Not after a quiet op, nor at a receive's own position once it was posted ahead
    (nothing runs there), nor after a BW or W of a stage other than its first in the step:
    those only let bytes go. Where receives are posted, always."""
    ahead = {j for js in posts.values() for j in js}
    seen: set[tuple[Op, int]] = set()
    out = []
    for k, instr in enumerate(program):
        first = (instr.op, instr.stage) not in seen
        if instr.op in FIRST_ONLY:
            seen.add((instr.op, instr.stage))
        quiet = k in ahead or instr.op in QUIET or (instr.op in FIRST_ONLY and not first)
        out.append(k in posts or not quiet)
    return tuple(out)


def run_in_turn(rank: Rank, instr: Instr) -> None:
    """OVERLAP: nothing. This runtime does not overlap the F&B pair: it runs the forward, then
    the backward (their sends and receives still overlap compute)."""


HANDLERS: Mapping[Op, Handler] = {
    Op.F: compute.forward,
    Op.B: compute.backward,
    Op.BW: compute.backward,
    Op.W: compute.weight_grad,
    Op.RECOMPUTE: compute.recompute,
    Op.SEND_ACT: p2p.send_act,
    Op.RECV_ACT: p2p.recv_act,
    Op.SEND_GRAD: p2p.send_grad,
    Op.RECV_GRAD: p2p.recv_grad,
    Op.EVICT: offload.evict,
    Op.LOAD: offload.load,
    Op.ACCEPT: offload.accept,
    Op.RETURN: offload.give_back,
    Op.ALLREDUCE_GRADS: grads.allreduce_grads,
    Op.OPTIMIZER_STEP: grads.optimizer_step,
    Op.OVERLAP: run_in_turn,
}


def check_program(program: Sequence[Instr], handlers: Mapping[Op, Handler], source: str) -> None:
    """Refuse, before any communication, a program with an op this runtime cannot execute."""
    for k, instr in enumerate(program):
        if instr.op not in handlers:
            raise PipecError(
                f"{source}:{k + FIRST_INSTR_LINE}: op {instr.op.value} has no runtime handler "
                f"(this runtime executes {', '.join(op.value for op in handlers)})"
            )


@dataclass(frozen=True)
class StepTrace:
    """One execution of the program, times in seconds of time.perf_counter() (on CUDA, when the
    GPU ran each instruction, on the same axis: runtime/clock.py).

    start[k] is when instruction k began its own work (after waiting for its inputs);
    handler_s sums the handlers' durations, so wall_s - handler_s is the interpreter's own cost.
    After instruction k: live[k] stash-counter bytes, real[k] the meter's real bytes (its last
    reading at or before k: it reads only where the bytes can rise, see `meter_points`).
    real_peak is the step's real peak (on CUDA including peaks inside instructions) and
    state_at_peak the parameters, gradients and optimizer state alive at the highest sample.
    full: the meter read at every position that can raise the bytes (`Sampling`).
    """

    begin: float
    start: tuple[float, ...]
    end: tuple[float, ...]
    live: tuple[int, ...]
    real: tuple[int, ...]
    real_peak: int
    state_at_peak: int
    wall_s: float
    handler_s: float
    full: bool


@dataclass(frozen=True)
class Positions:
    """What the loop needs to know about a rank's program beyond its instructions, the same
    every step (made at the first, kept on the rank): where receives are posted (`posts`:
    {k: receives posted before k}; `ahead`: the receives so posted, which do nothing at their
    own position), after which instructions the meter can read (`metered`) and does in each
    step (`sampling`), the parameters whose gradients the state at the peak counts; and the
    same facts position by position, as the loop reads them (a tuple lookup rather than a
    set's or a dict's: the loop's Python runs with the caches the compute left cold, and its
    every lookup counts): the receives posted before k, whether k runs at its position, ends
    an NCCL batch, allocates stash bytes."""

    posts: Mapping[int, tuple[int, ...]]
    ahead: frozenset[int]
    metered: tuple[bool, ...]
    sampling: Sampling
    params: tuple[nn.Parameter, ...]
    posted_at: tuple[tuple[int, ...], ...]
    runs_at: tuple[bool, ...]
    ends_at: tuple[bool, ...]
    allocates_at: tuple[bool, ...]

    @staticmethod
    def of(rt: Rank) -> Positions:
        program, comm = rt.program, rt.comm
        posts = {k: tuple(js) for k, js in post_points(program, comm.post_ahead).items()}
        ahead = frozenset(j for js in posts.values() for j in js)
        metered = meter_points(program, posts)
        ends = batch_ends(program) if comm.batched else frozenset()
        n = len(program)
        return Positions(
            posts,
            ahead,
            metered,
            Sampling(metered, always_full=rt.device.type == "cuda"),
            tuple(rt.parameters()),
            tuple(posts.get(k, ()) for k in range(n)),
            tuple(k not in ahead for k in range(n)),
            tuple(k in ends for k in range(n)),
            tuple(i.op in ALLOCATES for i in program),
        )


def run_program(
    rt: Rank, handlers: Mapping[Op, Handler], watchdog: Watchdog, full: bool = False
) -> StepTrace:
    """Execute the rank's program once (one training step); `full`: the meter reads at every
    position that can raise the bytes (the last step, whose timeline is written).

    Receives are posted where `post_points` says for `comm.post_ahead`: on gloo all of a
    step's at its start, since a gloo send whose receive is not posted waits for the
    receiver's notice, which a computing receiver delays by milliseconds; with NCCL at their
    program positions, the issue order it matches by (each batch issued by its last
    instruction). Posting has no dependencies and gloo matches by tag, so the order of compute
    and sends is unchanged; the cost is each buffer from its posting to its consumer, which the
    prediction counts.

    The meter reads only where the bytes can rise (`meter_points`), and on CPU in most steps
    only where full steps peaked (`Sampling`); after the other instructions the last reading
    stands, an upper bound of what they hold where they only let bytes go.
    """
    program, comm, counter = rt.program, rt.comm, rt.stash_bytes
    meter, pos = rt.meter, rt.positions_for(Positions.of)
    params, reads = pos.params, pos.sampling.next_step(full)
    posted_at, runs_at, ends_at, allocates_at = (
        pos.posted_at,
        pos.runs_at,
        pos.ends_at,
        pos.allocates_at,
    )
    run = [handlers[instr.op] for instr in program]
    n = len(program)
    begun, start, end = [0.0] * n, [0.0] * n, [0.0] * n
    live, real = [0] * n, [0] * n
    now, timer = time.perf_counter, clock.clock_for(rt.device, n)  # runtime/clock.py: CUDA
    marks = timer.marks
    mark_start, mark_end = (timer.start, timer.end) if marks else (None, None)
    best, state, sample = -1, 0, 0
    comm.waited = 0.0
    at_start = meter.model_state(params, rt.optimizer)  # no gradients yet: zeroed to None
    meter.start_step(at_start)
    t_begin = timer.begin()
    for k, instr in enumerate(program):
        comm.clock += 1
        for j in posted_at[k]:
            t0 = now()
            if marks:
                mark_start(j)
            watchdog.current = (j, t0)
            run[j](rt, program[j])
            if ends_at[j]:
                comm.flush()
            begun[j], start[j], end[j] = t0, t0, now()
            if marks:
                mark_end(j)
        if runs_at[k]:
            t0 = now()
            if marks:
                mark_start(k)
            watchdog.current = (k, t0)
            if allocates_at[k] and comm.in_flight:
                offload.settle(rt)
            run[k](rt, instr)
            if ends_at[k]:
                comm.flush()
            t1 = now()
            if marks:
                mark_end(k)
            waited = comm.waited  # what the handler waited for its inputs (Comm.take)
            if waited:
                comm.waited = 0.0
            begun[k], start[k], end[k] = t0, t0 + waited, t1
        if comm.in_flight:
            comm.poll()
        live[k] = counter.live
        if reads[k]:
            sample = meter.read()
            if sample > best:
                grads = [g for p in params if (g := grad_of(p)) is not None]
                best, state = sample, at_start + (tensors_nbytes(grads) if grads else 0)
        real[k] = sample
    watchdog.leave()
    handler = sum(map(sub, end, begun))
    start, end = timer.finish(t_begin, start, end)  # on CUDA: when the GPU ran each one
    wall = now() - t_begin
    pos.sampling.learn(reads, real)
    peak = meter.step_peak(real)
    full = reads is pos.metered
    return StepTrace(
        t_begin, start, end, tuple(live), tuple(real), peak, state, wall, handler, full
    )
