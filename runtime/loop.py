"""The training loop: every step starts after a barrier, runs the rank's program, and hands
its figures to every rank; at the end each rank's traces become OUT/measured/.

The only collectives are the barrier before each step and the gather of every rank's figures
after it (runtime/metrics.py). A run keeps the traces of its last `MEASURED_STEPS` steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from pipec.build_dir import MEASURED, title
from pipec.codegen.render import measured_table
from pipec.ir import Op
from pipec.plan.conditions import current
from pipec.runtime.barrier import step_barrier, who_left
from pipec.runtime.faults import Watchdog
from pipec.runtime.gather import all_gather_objects
from pipec.runtime.interpreter import Handler, StepTrace, run_program
from pipec.runtime.measure import rank_report, summarize, timeline, write
from pipec.runtime.metrics import StepFigures, gather_step
from pipec.runtime.rank import Rank

#: Steps whose traces a run keeps for OUT/measured/: the last ones. A trace holds every
#: instruction's times and bytes (~50 KB a step for a rank of 400 instructions): kept for
#: every step, a 100 000-step run would grow each rank's host memory by gigabytes.
MEASURED_STEPS = 100


def warmup_kept(skip: int, ran: int, kept: int) -> int:
    """How many of the last `kept` of `ran` steps are among the first `skip` (warm-up, left
    out of the medians), leaving at least one step measured."""
    return min(max(skip - (ran - kept), 0), kept - 1)


def seed_step(rt: Rank, step: int) -> None:
    """Training step `step` draws its random numbers (dropout's masks) from a stream of its
    own, seeded by the run's seed, the step and the rank: a resumed or restarted run draws
    what the uninterrupted run drew at that step."""
    seed = ((rt.data_seed * 1_000_003 + step) * 1_000_003 + rt.dp_index) * 1_000_003 + rt.rank
    # The rank's own generators: torch.manual_seed visits every backend's (132 us a call on
    # this 2-core host, against 1.1 us for the CPU generator alone).
    torch.default_generator.manual_seed(seed % 2**63)
    if rt.device.type == "cuda":
        torch.cuda.manual_seed(seed % 2**63)  # the rank's device is the current one


def train(
    rt: Rank,
    steps: int,
    handlers: Mapping[Op, Handler],
    watchdog: Watchdog,
    on_step: Callable[[int, float, StepTrace], None] | None = None,
    start: int = 0,
    after_step: Callable[[int], None] | None = None,
    report: Callable[[StepFigures], None] | None = None,
    keep: int = MEASURED_STEPS,
) -> list[StepTrace]:
    """Run the program for steps start+1 … `steps`; after each, `after_step(step)` (every rank,
    before the next step's barrier: checkpoints, evaluation) and later
    `on_step(step - 1, mean loss, trace)` and `report(every rank's figures)`. Returns the last
    `keep` steps' traces; `rt.step` is the last step run, before `steps` when a stop signal
    came (`watchdog.stopping`).

    The only collectives are the barrier before each step and the gather of every rank's
    figures after it (runtime/metrics.py: the loss sum, time, peak bytes, whether the rank was
    asked to stop). The gather is asynchronous and awaited after the next barrier, so a rank
    that stops between steps is mostly met in the barrier; one that dies just after passing it,
    its figures still on their way (gloo sends them in the background), fails the gather's
    wait, or the wait on the step's gradient norm (summed while the step ends): all are named
    by runtime/barrier.py. Since every rank sees every rank's stop flag, all of them stop after
    the same step.
    """
    traces: deque[StepTrace] = deque(maxlen=keep)
    pending: tuple[list[torch.Tensor], dist.Work] | None = None

    def finish_step() -> bool:
        rows, work = pending
        try:
            work.wait()
        except RuntimeError as e:  # a rank died after the barrier, its figures on the way
            raise who_left(e, f"while step {rt.step}'s figures were gathered") from None
        figures = StepFigures.of(rt.step, rows)
        if on_step:
            on_step(figures.step - 1, figures.loss, traces[-1])
        if report:
            report(figures)
        return figures.stopping

    for step in range(start, steps):
        watchdog.step = step + 1  # where a fault says it happened (its error file)
        # Every step starts together: one clock origin for all ranks.
        step_barrier(f"before step {step + 1}", watchdog.timeout)
        if pending and finish_step():
            return list(traces)
        seed_step(rt, step + 1)
        rt.new_step(step + 1)
        traces.append(run_program(rt, handlers, watchdog, full=step + 1 == steps))
        try:  # waits for the step's gradient norm (an all-reduce the optimizer step began)
            pending = gather_step(rt, traces[-1], watchdog.stopping.is_set())
        except RuntimeError as e:  # a rank died after its optimizer step
            raise who_left(e, f"while step {rt.step}'s gradient norm was summed") from None
        if after_step:
            after_step(step + 1)
    step_barrier("after the last step", watchdog.timeout)
    finish_step()
    return list(traces)


def write_measurements(rt: Rank, traces: list[StepTrace], skip: int) -> None:
    """Gather every rank's measurements; rank 0 writes measured/ and prints the comparison."""
    mine = rank_report(rt.grank, rt.program, rt.stash_bytes.peak, traces, rt.device.type)
    reports = all_gather_objects(mine, rt.device)
    if rt.grank != 0:
        return
    build = rt.build
    source = build.plan["model"]["cost"]["source"]
    # The backend decides where receives are posted, which the memory prediction follows.
    stats = summarize(reports, build.compiled, build.costs, source, skip)
    stats["backend"] = dist.get_backend()
    # What the memory prediction prices beside the real peaks (`pipec show`).
    precision = "bf16" if rt.compute_dtype else "fp32"
    stats |= {"precision": precision, "zero": rt.dp if rt.zero else 1}
    # What its times depend on, for a plan that folds them in (pipec/plan/conditions.py).
    run = current(torch.get_num_threads(), dist.get_world_size(), precision, rt.device.type)
    stats["conditions"] = run.to_json()
    write(build.path / MEASURED, stats, timeline(reports, title(build)))
    print(measured_table(stats), flush=True)
