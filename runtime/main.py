"""The runtime's entry point: what OUT/launch.py runs on every rank under torchrun.

    torchrun --nproc-per-node P OUT/launch.py [--steps N] [--lr LR] [--timeout S]

Order matters: read and check the build and rebuild this rank's stages (any defect is one
line and exit code 2, before any communication), then join the process group, then train for
N steps printing the loss, then write the measured timeline and figures to OUT/measured/ and
print them beside the simulation's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from codegen.render import measured_table
from passes.simulate import simulate
from pipec.build_dir import load, title
from pipec.ir import Op, PipecError
from runtime.faults import DEFAULT_TIMEOUT_S, Watchdog, report
from runtime.interpreter import HANDLERS, Handler, StepTrace, check_program, run_program
from runtime.measure import rank_report, summarize, timeline, write
from runtime.rank import Rank


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch.py", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds one instruction may wait before the run is called hung "
        f"({DEFAULT_TIMEOUT_S:g})",
    )
    ap.add_argument(
        "--model", default=None, help="factory spec, if not the plan's (e.g. moved file)"
    )
    ap.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl with CUDA, else gloo",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: cores / local ranks)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic micro-batches")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.timeout <= 0:
        ap.error("--steps must be at least 1 and --timeout positive")
    return args


def train(
    rt: Rank,
    steps: int,
    handlers: Mapping[Op, Handler],
    watchdog: Watchdog,
    on_step: Callable[[int, float, StepTrace], None] | None = None,
) -> list[StepTrace]:
    """Run the program `steps` times; after each, `on_step(step, mean loss, trace)`.

    The only collectives are the barrier before each step and the loss sum after it. The sum
    is asynchronous and awaited after the next barrier, so a rank that stops between steps is
    met in the barrier, which names it, never in the sum, where nobody could.
    """
    traces: list[StepTrace] = []
    pending: tuple[torch.Tensor, dist.Work] | None = None

    def finish_step() -> None:
        total, work = pending
        work.wait()
        loss_sum, count = total.tolist()
        if on_step:
            on_step(len(traces) - 1, loss_sum / count if count else float("nan"), traces[-1])

    for step in range(steps):
        # Every step starts together: one clock origin for all ranks.
        step_barrier(f"before step {step + 1}", watchdog.timeout)
        if pending:
            finish_step()
        traces.append(run_program(rt, handlers, watchdog))
        total = torch.tensor(
            [sum(rt.losses.values()), len(rt.losses)], dtype=torch.float64, device=rt.device
        )
        rt.losses.clear()
        pending = total, dist.all_reduce(total, async_op=True)
    step_barrier("after the last step", watchdog.timeout)
    finish_step()
    return traces


# Rank 0 gives up on the barrier this much sooner than the others give up on rank 0, so that
# it is the one to report, naming the ranks that never arrived.
BARRIER_SHARE = 0.75
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def step_barrier(where: str, timeout: float) -> None:
    """Wait until every rank is here; on gloo, a rank that is not says which ranks are missing."""
    if dist.get_backend() != "gloo":
        dist.barrier()
        return
    wait = timeout * BARRIER_SHARE if dist.get_rank() == 0 else timeout
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=wait), wait_all_ranks=True)
    except RuntimeError as e:
        missing = _MISSING.search(str(e))
        if not missing:
            raise
        ranks = missing[1].strip().rstrip(",")
        which = "rank" if "," not in ranks else "ranks"
        raise RuntimeError(
            f"{which} {ranks} did not reach the barrier {where} in {wait:g} s"
        ) from None


def main(
    build_dir: Path,
    argv: list[str] | None = None,
    handlers: Mapping[Op, Handler] = HANDLERS,
) -> None:
    """Run one rank (RANK, WORLD_SIZE, LOCAL_RANK from torchrun's environment)."""
    args = _parse(argv)
    env = os.environ
    grank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    try:
        build = load(build_dir)
        rt = Rank.prepare(build, grank, world, device, args.model, args.seed)
        check_program(rt.program, handlers, rt.source)
    except PipecError as e:  # nothing was communicated: a plain exit, no other rank is waiting
        print(f"pipec runtime: rank {grank}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    watchdog = Watchdog(args.timeout, rt.describe)
    try:
        rt.connect(lambda params: torch.optim.AdamW(params, lr=args.lr), args.timeout)
        log = _log_step(rt, args.steps) if grank == 0 else None
        traces = train(rt, args.steps, handlers, watchdog, log)
        write_measurements(rt, traces, args.skip)
    except Exception as e:  # noqa: BLE001 - any failure: say where this rank was, then exit
        report(f"{watchdog.where()}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    watchdog.stop()
    dist.destroy_process_group()


def _log_step(rt: Rank, steps: int) -> Callable[[int, float, StepTrace], None]:
    def log(step: int, loss: float, trace: StepTrace) -> None:
        print(
            f"step {step + 1:>3}/{steps}  loss {loss:.4f}  ({trace.wall_s * 1000:.1f} ms)",
            flush=True,
        )

    return log


def write_measurements(rt: Rank, traces: list[StepTrace], skip: int) -> None:
    """Gather every rank's measurements; rank 0 writes measured/ and prints the comparison."""
    mine = rank_report(rt.grank, rt.program, rt.peak, traces, rt.device.type)
    reports: list | None = [None] * rt.world if rt.grank == 0 else None
    dist.gather_object(mine, reports, dst=0)
    if rt.grank != 0:
        return
    build = rt.build
    c = build.compiled
    sim = simulate(c.layout, c.programs, build.costs)
    source = build.plan["model"]["cost"]["source"]
    stats = summarize(reports, sim, source, skip)
    write(build.path / "measured", stats, timeline(reports, title(build)))
    print(measured_table(stats), flush=True)
