"""The runtime's entry point: what OUT/launch.py runs on every rank under torchrun.

    torchrun --nproc-per-node P OUT/launch.py [--steps N] [--lr LR] [--save DIR]
        [--save-every K] [--resume DIR] [--check-grads] [--timeout S] [--model SPEC]
        [--backend gloo|nccl] [--share-gpu]

The backend is NCCL with CUDA (one GPU per rank), else gloo on CPU; `--share-gpu` runs several
ranks on each GPU over gloo, their messages staged through host memory (runtime/p2p.py), which
is how a one-GPU machine runs a real pipeline.

Order matters. First the checks every rank would fail alike (backend, the build read and
verified, world size, the model's factory found and still matching the plan, the checkpoint to
resume from): rank 0 says what is wrong in one line, every rank exits 2. Then this rank's
stages are rebuilt (a defect: one line from that rank, exit 2). Only then does the rank join the
process group, load the checkpoint, and train to step N printing the loss, saving every K steps
and at the end; last, the measured timeline and figures go to OUT/measured/ and are printed
beside the simulation's. `--check-grads` instead runs one step and compares every stage's
gradients with the plain model's (runtime/gradcheck.py); exit 1 when one differs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from codegen.render import measured_table
from passes.simulate import simulate
from pipec import checkpoint
from pipec.build_dir import MEASURED, Build, check_build, load, title
from pipec.frontend import FrontendError, load_factory
from pipec.ir import Op, PipecError
from pipec.provenance import check_model, resolve
from runtime import named_state
from runtime.data import open_source
from runtime.faults import DEFAULT_TIMEOUT_S, Watchdog, report
from runtime.gradcheck import GradCapture, compare, reference_grads
from runtime.interpreter import HANDLERS, Handler, StepTrace, check_program, run_program
from runtime.measure import rank_report, summarize, timeline, write
from runtime.optim import NonFinite, Trainer
from runtime.options import add_training_options, train_options, training_error
from runtime.rank import Rank, check_runnable


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch.py", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
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
        help="default: nccl with CUDA (gloo with --share-gpu), else gloo",
    )
    ap.add_argument(
        "--share-gpu",
        action="store_true",
        help="the ranks of a node share its GPUs (all of them one GPU on a one-GPU machine): "
        "gloo, messages through page-locked host memory",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: cores / local ranks)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic micro-batches")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians")
    ap.add_argument("--save", type=Path, help="write checkpoints to DIR (at the end at least)")
    ap.add_argument("--save-every", type=int, default=0, help="and every K steps (default: 0)")
    ap.add_argument(
        "--resume", type=Path, help="continue from a checkpoint: DIR's newest, or DIR/step_N"
    )
    ap.add_argument(
        "--check-grads",
        action="store_true",
        help="one step; compare each stage's gradients with the plain model's; exit 1 if not equal",
    )
    ap.add_argument(
        "--no-verify", action="store_true", help="skip `pipec verify`'s checks (huge builds)"
    )
    add_training_options(ap)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.timeout <= 0 or args.save_every < 0:
        ap.error("--steps must be at least 1, --timeout positive, --save-every 0 or more")
    if args.check_grads and args.save:
        ap.error("--check-grads runs one step and saves nothing; drop --save")
    if error := training_error(args):
        ap.error(error)
    return args


def train(
    rt: Rank,
    steps: int,
    handlers: Mapping[Op, Handler],
    watchdog: Watchdog,
    on_step: Callable[[int, float, StepTrace], None] | None = None,
    start: int = 0,
    after_step: Callable[[int], None] | None = None,
) -> list[StepTrace]:
    """Run the program for steps start+1 … `steps`; after each, `after_step(step)` (every rank,
    before the next step's barrier: checkpoints) and later `on_step(step - 1, mean loss, trace)`.

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
            on_step(
                start + len(traces) - 1, loss_sum / count if count else float("nan"), traces[-1]
            )

    for step in range(start, steps):
        # Every step starts together: one clock origin for all ranks.
        step_barrier(f"before step {step + 1}", watchdog.timeout)
        if pending:
            finish_step()
        rt.new_step(step + 1)
        traces.append(run_program(rt, handlers, watchdog))
        total = torch.tensor(
            [sum(rt.losses.values()), len(rt.losses)], dtype=torch.float64, device=rt.device
        )
        rt.losses.clear()
        pending = total, dist.all_reduce(total, async_op=True)
        if after_step:
            after_step(step + 1)
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


@dataclass(frozen=True)
class Run:
    """What the checks every rank makes alike found: the build, the model's spec (resolved
    from any directory), the checkpoint to resume from and its step."""

    build: Build
    spec: str
    resume: Path | None
    start: int


def preflight(build_dir: Path, args: argparse.Namespace, world: int, local_world: int) -> Run:
    """The checks whose verdict is the same on every rank; PipecError names the defect."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.share_gpu:
        if args.backend == "nccl":
            raise PipecError(
                "--share-gpu runs on gloo: NCCL refuses two ranks on one GPU; drop --backend nccl"
            )
        if gpus == 0:
            raise PipecError(
                "--share-gpu needs CUDA, and torch sees no GPU here; drop it to run on CPU"
            )
    elif args.backend == "nccl":
        if gpus == 0:
            raise PipecError("--backend nccl needs CUDA, and torch sees no GPU here; use gloo")
        if local_world > gpus:
            raise PipecError(
                f"--backend nccl: {local_world} ranks on this node but {gpus} GPUs; "
                f"launch at most {gpus} per node"
            )
    build = load(build_dir)
    if not args.no_verify:
        try:
            check_build(build)
        except PipecError as e:
            raise PipecError(
                f"{build.path} fails verification: {e} (recompile; --no-verify skips this check)"
            ) from None
    check_runnable(build, world)
    if args.zero and int(build.plan.get("dp", 1)) < 2:
        raise PipecError(
            "--zero 1 shards the optimizer over data-parallel copies, and this build has one; "
            "compile with --dp 2 or more, or drop --zero"
        )
    model_plan = build.plan["model"]
    spec = resolve(model_plan, args.model, build.path)
    try:
        factory = load_factory(spec, model_plan["seed"], model_plan.get("micro_batch_size"))
    except FrontendError as e:
        raise PipecError(f"{e}; pass --model path/to/file.py:factory if it moved") from None
    check_model(factory.model, model_plan, spec)
    if args.save and checkpoint.checkpoints(args.save) and not args.resume:
        raise PipecError(
            f"--save {args.save} already holds checkpoints (newest "
            f"{checkpoint.checkpoints(args.save)[-1].name}); continue them with --resume "
            f"{args.save}, or save elsewhere"
        )
    resume, start = None, 0
    if args.resume:
        resume = checkpoint.latest(args.resume)
        checkpoint.check_fits(resume, factory.model)
        start = checkpoint.saved_step(resume)
        if start >= args.steps and not args.check_grads:
            raise PipecError(
                f"{resume} is at step {start} and --steps is {args.steps}: nothing to train; "
                "--steps counts from the first step, raise it"
            )
    return Run(build, spec, resume, start)


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
    cuda = torch.cuda.is_available() and not args.share_gpu
    args.backend = args.backend or ("nccl" if cuda else "gloo")
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    try:
        run = preflight(build_dir, args, world, local_world)
    except PipecError as e:  # every rank found the same: rank 0 says it, nobody waits
        if grank == 0:
            print(f"pipec runtime: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    device = rank_device(args.backend, args.share_gpu, local_rank)
    try:
        rt = Rank.prepare(run.build, grank, world, device, run.spec, args.seed)
        check_program(rt.program, handlers, rt.source)
    except PipecError as e:  # nothing was communicated: a plain exit, no other rank is waiting
        print(f"pipec runtime: rank {grank}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    watchdog = Watchdog(args.timeout, rt.describe)
    code = 0
    try:
        options = train_options(args)
        rt.connect(
            GradCapture if args.check_grads else lambda _: Trainer(rt, options), args.timeout
        )
        restore(rt, run.resume, args.seed)
        if args.check_grads:
            code = int(check_grads(rt, run, handlers, watchdog, args.seed))
        else:
            saved: dict[int, Path] = {}
            log = _log_step(args.steps, saved) if grank == 0 else None
            save = saver(rt, args.save, args.save_every, args.steps, saved) if args.save else None
            traces = train(rt, args.steps, handlers, watchdog, log, run.start, save)
            write_measurements(rt, traces, min(args.skip, len(traces) - 1))
            if grank == 0 and args.skip_nonfinite:
                print(f"skipped {rt.optimizer.skipped} non-finite steps", flush=True)
    except NonFinite as e:  # every rank found it in the same all-reduce: rank 0 says it
        if grank == 0:
            print(f"pipec runtime: {e}", file=sys.stderr, flush=True)
        code = 3
    except Exception as e:  # noqa: BLE001 - any failure: say where this rank was, then exit
        report(f"{watchdog.where()}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    watchdog.stop()
    dist.destroy_process_group()
    if code:
        sys.exit(code)


def rank_device(backend: str, share_gpu: bool, local_rank: int) -> torch.device:
    """Where a rank computes: its own GPU with NCCL; with --share-gpu, GPU local_rank modulo
    the node's GPUs (several ranks on each, over gloo); else the CPU."""
    if share_gpu:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")


def restore(rt: Rank, resume: Path | None, seed: int) -> int:
    """Load checkpoint `resume` (if any) into this rank's stages (and a Trainer's masters and
    optimizer state), and open the data where it stopped; returns the step to continue from."""
    start = 0
    if resume and isinstance(rt.optimizer, Trainer):
        start = named_state.load(rt.optimizer, resume)
    elif resume:  # --check-grads: the weights only
        start = checkpoint.load(resume, rt.modules.values())
    rt.data = open_source(rt.spec, rt.layout.m * rt.dp, seed, start)
    return start


def saver(
    rt: Rank, directory: Path, every: int, last: int, saved: dict[int, Path]
) -> Callable[[int], None]:
    """After step k: a checkpoint in `directory` when k is a multiple of `every` (0: never) or
    is the `last` step; its path goes into `saved`, for the step's log line.

    One copy of each stage is written: the first pipeline's stages (bidirectional schedules
    hold a replica of each in the second) of the first data-parallel copy."""
    first = set(rt.layout.pipelines[0].stages)
    mine = [m for s, m in rt.modules.items() if s in first] if rt.dp_index == 0 else []

    def save(step: int) -> None:
        if step == last or (every and step % every == 0):
            state = named_state.state_dict(rt.optimizer, mine)  # every ZeRO copy gathers
            saved[step] = checkpoint.save(directory, step, state)

    return save


def check_grads(
    rt: Rank, run: Run, handlers: Mapping[Op, Handler], watchdog: Watchdog, seed: int
) -> bool:
    """One step, then every stage's gradients against the plain model's on the same batch;
    rank 0 prints one line per stage. True when a stage differs (on every rank)."""
    train(rt, run.start + 1, handlers, watchdog, start=run.start)
    model_plan = rt.build.plan["model"]
    plain = load_factory(run.spec, model_plan["seed"], model_plan.get("micro_batch_size"))
    if run.resume:
        checkpoint.load(run.resume, [plain.model])
    batches = open_source(plain, rt.layout.m * rt.dp, seed, run.start).next()
    ref = reference_grads(plain.model, plain.loss_fn, batches, rt.device)
    checks = compare(rt.modules, rt.grank, rt.optimizer.grads, ref)
    everyone: list = [None] * rt.world
    dist.all_gather_object(everyone, checks)
    found = sorted((c for cs in everyone for c in cs), key=lambda c: (c.stage, c.rank))
    bad = sorted({c.stage for c in found if c.error})
    if rt.grank == 0:
        print(
            f"check-grads: step {run.start + 1}, {len(batches)} micro-batches, against "
            "loss.backward() of the unsplit model (torch.testing.assert_close tolerances)",
            flush=True,
        )
        print("\n".join(c.line() for c in found), flush=True)
        if bad:
            print(
                "pipec runtime: check-grads failed: "
                + (f"stage {bad[0]} differs" if len(bad) == 1 else f"stages {_join(bad)} differ")
                + " from the plain model's gradients",
                file=sys.stderr,
                flush=True,
            )
        else:
            print("check-grads: ok, every stage matches", flush=True)
    return bool(bad)


def _join(items: list[int]) -> str:
    return ", ".join(map(str, items))


def _log_step(steps: int, saved: dict[int, Path]) -> Callable[[int, float, StepTrace], None]:
    def log(step: int, loss: float, trace: StepTrace) -> None:
        path = saved.get(step + 1)
        print(
            f"step {step + 1:>3}/{steps}  loss {loss:.4f}  ({trace.wall_s * 1000:.1f} ms)"
            + (f"  saved {path}" if path else ""),
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
    # The backend decides where receives are posted, which the memory prediction follows.
    stats = summarize(reports, sim, source, skip) | {"backend": dist.get_backend()}
    # What the memory prediction prices beside the real peaks (`pipec show`).
    stats |= {"precision": "bf16" if rt.compute_dtype else "fp32", "zero": rt.dp if rt.zero else 1}
    write(build.path / MEASURED, stats, timeline(reports, title(build)))
    print(measured_table(stats), flush=True)
