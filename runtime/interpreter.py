"""The interpreter: execute one rank's program in order through a dispatch table.

    for k, instr in enumerate(program):
        HANDLERS[instr.op](rank, instr)

plus what makes it measurable and safe: each instruction's start (after any wait for its
input) and end, the live stash bytes after it, and the watchdog told where the rank is. The
interpreter never reorders compute or sends; what overlaps is what the program posted
(receives; on gloo all of a step's are posted at its start) or issued (sends, all-reduces)
before. An op without a handler is refused before the run starts, naming
the op and its line; an instruction that raises leaves the watchdog pointing at it, so the
entry point's report names it and its line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pipec.ir import Instr, Op, PipecError
from runtime import clock, compute, grads, offload, p2p
from runtime.faults import Watchdog
from runtime.rank import FIRST_INSTR_LINE, Rank

Handler = Callable[[Rank, Instr], None]


def run_in_turn(rank: Rank, instr: Instr) -> None:
    """OVERLAP is a hint that the next F and B may run concurrently; this runtime runs them
    one after the other (their sends and receives already overlap compute)."""


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
    """

    begin: float
    start: tuple[float, ...]
    end: tuple[float, ...]
    live: tuple[int, ...]
    wall_s: float
    handler_s: float


RECEIVES = frozenset({Op.RECV_ACT, Op.RECV_GRAD})


def run_program(rt: Rank, handlers: Mapping[Op, Handler], watchdog: Watchdog) -> StepTrace:
    """Execute the rank's program once (one training step).

    With `comm.post_early` (gloo), the step's activation and gradient receives are all posted
    first, in program order: a gloo send whose receive is not posted yet waits for the
    receiver's notice to reach the *sender's* I/O thread, which a computing sender leaves
    without a core for milliseconds. Posting has no dependencies and gloo matches by tag, so
    the order of compute and sends is unchanged; the cost is the buffers of the step's
    not-yet-consumed inputs.
    """
    program, comm = rt.program, rt.comm
    n = len(program)
    begun, start, end, live = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
    now, timer = time.perf_counter, clock.clock_for(rt.device, n)  # runtime/clock.py: CUDA
    comm.pop_waited()
    t_begin = timer.begin()
    early = [k for k, i in enumerate(program) if i.op in RECEIVES] if comm.post_early else []
    for k in early:
        t0 = timer.start(k)
        watchdog.enter(k, t0)
        handlers[program[k].op](rt, program[k])
        begun[k], start[k], end[k] = t0, t0, timer.end(k)
    skip = frozenset(early)
    for k, instr in enumerate(program):
        if k in skip:
            live[k] = rt.live
            continue
        t0 = timer.start(k)
        watchdog.enter(k, t0)
        handlers[instr.op](rt, instr)
        t1 = timer.end(k)
        begun[k], start[k], end[k], live[k] = t0, t0 + comm.pop_waited(), t1, rt.live
    watchdog.leave()
    handler = sum(e - b for b, e in zip(begun, end))
    start, end = timer.finish(t_begin, start, end)  # on CUDA: when the GPU ran each one
    wall = now() - t_begin
    return StepTrace(t_begin, tuple(start), tuple(end), tuple(live), wall, handler)
