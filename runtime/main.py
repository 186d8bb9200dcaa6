"""The runtime's entry point: what OUT/launch.py runs on every rank under torchrun.

    torchrun --nproc-per-node P OUT/launch.py [--steps N] [--lr LR] [--save DIR]
        [--save-every K] [--resume DIR] [--check-grads] [--timeout S] [--model SPEC]
        [--backend gloo|nccl] [--share-gpu] [--config FILE.toml] [--tensorboard DIR]
        [--eval-every K] [--eval-steps N] [--peak-tflops X]

The options become the run's config once (runtime/options.py, runtime/config.py). The backend
is NCCL with CUDA (one GPU per rank), else gloo on CPU; `--share-gpu` runs several ranks on each
GPU over gloo, their messages staged through host memory (runtime/p2p.py), which is how a
one-GPU machine runs a real pipeline.

Order matters. A rank started by torchrun first makes sure it dies with torchrun
(runtime/faults.py). Then the checks every rank would fail alike (runtime/preflight.py): rank 0
says what is wrong in one line, every rank exits 2. Then this rank's stages are rebuilt (a
defect: one line from that rank, exit 2). Only then does the rank join the process group; rank
0 takes the build's lock and starts a rollback's branch (runtime/checkpoint_hooks.py's
`claim`: a failure is said by rank 0, every rank exits 2); each rank loads the checkpoint and
trains to step N, rank 0 printing each step's metrics and writing them to
OUT/measured/metrics.jsonl (runtime/metrics.py), saving every K steps and at the end (written
in the background: runtime/saving.py), evaluating every K' steps (runtime/evaluate.py); last,
the measured timeline and figures go to OUT/measured/ and are printed beside the simulation's.
A stop signal (runtime/faults.py) ends training after the step under way, with a last
checkpoint when saving (runtime/stopping.py). `--check-grads` instead runs one step and
compares every stage's gradients with the plain model's (runtime/gradcheck.py); exit 1 when one
differs.

Restarted by torchrun (`pipec run --max-restarts N`), a rank is of the same run: it resumes
from the newest intact checkpoint the run wrote into --save and joins its attempt's own
process group (runtime/restart.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch

from pipec.frontend.precision import PRECISIONS
from pipec.ir import Op, PipecError
from pipec.plan.conditions import current, notice
from pipec.progress import progress
from pipec.runtime.checkpoint_hooks import claim, restore, saver
from pipec.runtime.config import LaunchConfig
from pipec.runtime.evaluate import evaluator
from pipec.runtime.faults import Watchdog, end_with_parent
from pipec.runtime.gradcheck import GradCapture, check_grads
from pipec.runtime.inject import inject
from pipec.runtime.interpreter import HANDLERS, Handler, check_program
from pipec.runtime.loop import train, warmup_kept, write_measurements
from pipec.runtime.metrics import Metrics, open_metrics
from pipec.runtime.optim import Trainer
from pipec.runtime.options import changed, parse_launch
from pipec.runtime.preflight import Run, preflight, rank_device
from pipec.runtime.rank import Rank
from pipec.runtime.restart import attempt, join
from pipec.runtime.saving import Saver
from pipec.runtime.stopping import failed, finish, stopped
from pipec.terminal import printable

#: What a rank's start-up does, by module (pipec.progress: the outermost on the stack names it).
START_STEPS = (
    ("pipec.runtime.rank", "rebuilding its stages from the factory"),
    ("pipec.frontend", "building the model from its factory"),
    ("pipec.build_dir", "reading and verifying the build"),
    ("pipec.checkpoint", "reading the checkpoint"),
)


def main(
    build_dir: Path,
    argv: list[str] | None = None,
    handlers: Mapping[Op, Handler] = HANDLERS,
) -> None:
    """Run one rank (RANK, WORLD_SIZE, LOCAL_RANK from torchrun's environment)."""
    config = parse_launch(argv)
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:  # started by torchrun: no rank trains on once it is gone
        end_with_parent()
    grank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    handlers = inject(handlers, grank, attempt())  # PIPEC_FAULT: tests only
    local_rank, local_world = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(config.run.threads or max(1, (os.cpu_count() or 1) // local_world))
    # Rank 0 says what the start-up is doing while it takes long (all ranks do the same).
    starting = progress(f"rank 0 of {world} starting", START_STEPS) if grank == 0 else nullcontext()
    with starting:
        run, rt = start(build_dir, config, handlers, grank, world, (local_rank, local_world))
    if rt.device.type == "cuda":
        torch.cuda.set_device(rt.device)
    if grank == 0:
        print(f"config: {changed(config)}", flush=True)
        # A plan's predicted time holds under the conditions its times were measured under.
        here = current(torch.get_num_threads(), world, config.training.precision, rt.device.type)
        if said := notice(run.build.plan["model"].get("planned"), here):
            print(f"pipec runtime: notice: {said}", file=sys.stderr, flush=True)
    join(config.run.backend, timedelta(seconds=config.run.timeout))
    claim(run, grank, rt.device)
    if grank == 0 and run.resume:
        print(f"resuming from {run.resume} (step {run.start})", flush=True)
    watchdog = Watchdog(config.run.timeout, rt.describe)
    code = 0
    metrics: Metrics | None = None
    save: Saver | None = None
    try:
        options = config.training.trainer_options()
        checking = config.run.check_grads
        rt.connect(GradCapture if checking else lambda _: Trainer(rt, options), config.run.timeout)
        restore(rt, run.resume, config.training.seed)
        if checking:
            code = int(check_grads(rt, run, handlers, watchdog, config.training.seed))
        else:
            if grank == 0:
                metrics = open_metrics(rt, config)
                print(config.training_line(), flush=True)
            save = saver(rt, config, run)
            training(rt, config, run, handlers, watchdog, metrics, save)
    except Exception as e:  # noqa: BLE001 - any failure: say where this rank was, then exit
        code = failed(e, grank, watchdog)
    finish(code, watchdog, save, metrics)


def start(
    build_dir: Path,
    config: LaunchConfig,
    handlers: Mapping[Op, Handler],
    grank: int,
    world: int,
    local: tuple[int, int],
) -> tuple[Run, Rank]:
    """The checks every rank makes alike (a defect: rank 0 says it, every rank exits 2), then
    this rank's stages rebuilt and its program checked against `handlers` (a defect: this rank
    says it, exit 2). Nothing is communicated: nobody waits for a rank that exits here.
    `local`: this rank's place on its node and the node's ranks."""
    local_rank, local_world = local
    try:
        run = preflight(build_dir, config, world, local_world, say=grank == 0)
    except PipecError as e:  # every rank found the same: rank 0 says it, nobody waits
        if grank == 0:
            print(f"pipec runtime: {printable(str(e))}", file=sys.stderr, flush=True)
        sys.exit(2)
    device = rank_device(config.run.backend, config.run.share_gpu, local_rank)
    try:
        dtype = PRECISIONS[config.training.precision]  # bf16: the stages captured as they compute
        rt = Rank.prepare(run.build, grank, world, device, run.spec, config.training.seed, dtype)
        check_program(rt.program, handlers, rt.source)
    except PipecError as e:
        print(f"pipec runtime: rank {grank}: {printable(str(e))}", file=sys.stderr, flush=True)
        sys.exit(2)
    return run, rt


def training(
    rt: Rank,
    config: LaunchConfig,
    run: Run,
    handlers: Mapping[Op, Handler],
    watchdog: Watchdog,
    metrics: Metrics | None,
    save: Saver | None,
) -> None:
    """Train from `run.start` to --steps: after each step save and evaluate when due, rank 0
    logs the step's figures; then the measurements, or after a stop signal a last checkpoint."""
    steps = config.training.steps
    evaluation = evaluator(rt, config.eval.eval_every, config.eval.eval_steps, watchdog, metrics)
    after = [hook for hook in (save, evaluation) if hook]
    traces = train(
        rt,
        steps,
        handlers,
        watchdog,
        start=run.start,
        after_step=lambda step: [hook(step) for hook in after],
        report=metrics and (lambda fig: metrics.log(fig, save and save.writer.completed())),
    )
    done = max(rt.step, run.start)
    if done < steps:  # stopped by a signal: keep what was trained
        stopped(rt.grank, watchdog.signal_name, run.start, done, steps, save)
    else:
        skip = warmup_kept(config.metrics.skip, done - run.start, len(traces))
        write_measurements(rt, traces, skip)
    if rt.grank == 0 and config.training.skip_nonfinite:
        print(f"skipped {rt.optimizer.skipped} non-finite steps", flush=True)
