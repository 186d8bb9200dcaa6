"""The runtime's entry point: what OUT/launch.py runs on every rank under torchrun.

    torchrun --nproc-per-node P OUT/launch.py [--steps N] [--lr LR] [--save DIR]
        [--save-every K] [--resume DIR] [--check-grads] [--timeout S] [--model SPEC]
        [--backend gloo|nccl] [--share-gpu] [--config FILE.toml] [--tensorboard DIR]
        [--eval-every K] [--eval-steps N] [--peak-tflops X]

The backend is NCCL with CUDA (one GPU per rank), else gloo on CPU; `--share-gpu` runs several
ranks on each GPU over gloo, their messages staged through host memory (runtime/p2p.py), which
is how a one-GPU machine runs a real pipeline.

Order matters. A rank started by torchrun first makes sure it dies with torchrun
(runtime/faults.py). Then the checks every rank would fail alike (backend, the build read and
verified, world size, the model's factory found and still matching the plan, the checkpoint to
resume from and its contents, the --save directory's lineage): rank 0 says what is wrong in one
line, every rank exits 2. Then this rank's stages are rebuilt (a defect: one line from that
rank, exit 2). Only then does the rank join the process group; rank 0 takes the build's lock
and starts a rollback's branch (`claim`: a failure is said by rank 0, every rank exits 2);
each rank loads the checkpoint and trains to step N, rank 0 printing each step's metrics
and writing them to OUT/measured/metrics.jsonl (runtime/metrics.py), saving every K steps and
at the end (written in the background: runtime/saving.py), evaluating every K' steps
(runtime/evaluate.py); last, the measured timeline and
figures go to OUT/measured/ and are printed beside the simulation's. A stop signal
(runtime/faults.py) ends training after the step under way, with a last checkpoint when
saving. `--check-grads` instead runs one step and compares every stage's gradients with the
plain model's (runtime/gradcheck.py); exit 1 when one differs.

Restarted by torchrun (`pipec run --max-restarts N`), a rank is of the same run: it resumes
from the newest intact checkpoint the run wrote into --save and joins its attempt's own
process group (runtime/restart.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipec import checkpoint, run_lock
from pipec.build_dir import Build, check_build, load, os_error
from pipec.checkpoint_lineage import Lineage, check_save, later_than, set_aside
from pipec.frontend import FrontendError, load_factory
from pipec.frontend.precision import PRECISIONS
from pipec.ir import Op, PipecError
from pipec.plan.conditions import current, notice
from pipec.progress import progress
from pipec.provenance import check_model, resolve
from pipec.run_checks import check_writable
from pipec.runtime import named_state
from pipec.runtime.data import open_source
from pipec.runtime.evaluate import evaluator
from pipec.runtime.faults import Watchdog, end_with_parent, report
from pipec.runtime.gather import all_gather_objects
from pipec.runtime.gradcheck import DropoutOff, GradCapture, compare, reference_grads
from pipec.runtime.inject import inject
from pipec.runtime.interpreter import HANDLERS, Handler, check_program
from pipec.runtime.loop import train, warmup_kept, write_measurements
from pipec.runtime.metrics import Metrics, open_metrics
from pipec.runtime.offload import size_moves
from pipec.runtime.optim import NonFinite, Trainer
from pipec.runtime.options import changed, effective, launch_parser, parse_launch
from pipec.runtime.rank import Rank, check_runnable
from pipec.runtime.restart import attempt, join, resume_from, run_id
from pipec.runtime.saving import Saver, stopped
from pipec.runtime.train_options import (
    train_options,
    zero_error,
)
from pipec.terminal import printable

#: What a rank's start-up does, by module (pipec.progress: the outermost on the stack names it).
START_STEPS = (
    ("pipec.runtime.rank", "rebuilding its stages from the factory"),
    ("pipec.frontend", "building the model from its factory"),
    ("pipec.build_dir", "reading and verifying the build"),
    ("pipec.checkpoint", "reading the checkpoint"),
)


@dataclass(frozen=True)
class Run:
    """What the checks every rank makes alike found: the build, the model's spec (resolved
    from any directory), the checkpoint to resume from and its step, the run's lineage, the
    directory it saves into (None: it saves nothing) and the checkpoints there after the one
    resumed from (a new branch abandons them)."""

    build: Build
    spec: str
    resume: Path | None
    start: int
    lineage: Lineage
    save: Path | None = None
    abandoned: tuple[Path, ...] = ()


def preflight(
    build_dir: Path, args: argparse.Namespace, world: int, local_world: int, say: bool = True
) -> Run:
    """The checks whose verdict is the same on every rank; PipecError names the defect. `say`:
    this rank prints the notices (a damaged newest checkpoint skipped). Changes nothing on
    disk but the probe of --save: a rollback's branch is `claim`'s, after every rank joined."""
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
    if error := zero_error(args, int(build.plan.get("dp", 1))):
        raise PipecError(error)
    model_plan = build.plan["model"]
    spec = resolve(model_plan, args.model, build.path)
    try:
        factory = load_factory(spec, model_plan["seed"], model_plan.get("micro_batch_size"))
    except FrontendError as e:
        raise PipecError(f"{e}; pass --model path/to/file.py:factory if it moved") from None
    check_model(factory.model, model_plan, spec)
    if args.save:
        check_writable(args.save)  # now, not after training
    if args.eval_every and factory.eval_data is None and not args.check_grads:
        raise PipecError(
            f"--eval-every {args.eval_every}: the ModelSpec of {spec} has no eval_data; give it "
            "eval_data (batches in the form of data) or drop --eval-every"
        )
    resume, start = None, 0
    run = run_id()
    given = resume_from(args.save, args.resume, run) if attempt() else args.resume
    if given:
        resume, skipped = checkpoint.newest_intact(given)
        if say:
            for line in skipped:
                print(f"pipec runtime: notice: {line}", file=sys.stderr, flush=True)
        checkpoint.check_fits(resume, factory.model)
        start = checkpoint.saved_step(resume)
        if start >= args.steps and not args.check_grads:
            raise PipecError(
                f"{resume} is at step {start} and --steps is {args.steps}: nothing to train; "
                "--steps counts from the first step, raise it"
            )
    lineage = Lineage.new(build.plan, build.plan_hash, resume, run)
    if not args.save or args.check_grads:  # --check-grads saves nothing
        return Run(build, spec, resume, start, lineage)
    check_save(args.save, given, lineage)
    later = later_than(args.save, resume) if resume else []
    return Run(build, spec, resume, start, lineage, Path(args.save), tuple(later))


def main(
    build_dir: Path,
    argv: list[str] | None = None,
    handlers: Mapping[Op, Handler] = HANDLERS,
) -> None:
    """Run one rank (RANK, WORLD_SIZE, LOCAL_RANK from torchrun's environment)."""
    args = parse_launch(argv)
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:  # started by torchrun: no rank trains on once it is gone
        end_with_parent()
    grank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    handlers = inject(handlers, grank, attempt())  # PIPEC_FAULT: tests only
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    cuda = torch.cuda.is_available() and not args.share_gpu
    args.backend = args.backend or ("nccl" if cuda else "gloo")
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    # Rank 0 says what the start-up is doing while it takes long (all ranks do the same).
    starting = progress(f"rank 0 of {world} starting", START_STEPS) if grank == 0 else nullcontext()
    with starting:
        try:
            run = preflight(build_dir, args, world, local_world, say=grank == 0)
        except PipecError as e:  # every rank found the same: rank 0 says it, nobody waits
            if grank == 0:
                print(f"pipec runtime: {printable(str(e))}", file=sys.stderr, flush=True)
            sys.exit(2)
        device = rank_device(args.backend, args.share_gpu, local_rank)
        try:
            dtype = PRECISIONS[args.precision]  # bf16: the stages captured as they compute
            rt = Rank.prepare(run.build, grank, world, device, run.spec, args.seed, dtype)
            check_program(rt.program, handlers, rt.source)
        except PipecError as e:  # nothing was communicated: a plain exit, nobody is waiting
            print(f"pipec runtime: rank {grank}: {printable(str(e))}", file=sys.stderr, flush=True)
            sys.exit(2)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if grank == 0:
        print(f"config: {changed(launch_parser(), args)}", flush=True)
        # A plan's predicted time holds under the conditions its times were measured under.
        here = current(torch.get_num_threads(), world, args.precision, device.type)
        if said := notice(run.build.plan["model"].get("planned"), here):
            print(f"pipec runtime: notice: {said}", file=sys.stderr, flush=True)
    join(args.backend, timedelta(seconds=args.timeout))
    claim(run, grank, device)
    if grank == 0 and run.resume:
        print(f"resuming from {run.resume} (step {run.start})", flush=True)
    watchdog = Watchdog(args.timeout, rt.describe)
    code = 0
    metrics: Metrics | None = None
    save: Saver | None = None
    try:
        options = train_options(args)
        rt.connect(
            GradCapture if args.check_grads else lambda _: Trainer(rt, options), args.timeout
        )
        size_moves(rt)  # a bf16 run's stash moves: their bytes at bf16
        restore(rt, run.resume, args.seed)
        if args.check_grads:
            code = int(check_grads(rt, run, handlers, watchdog, args.seed))
        else:
            if grank == 0:
                config = effective(launch_parser(), args)
                metrics = open_metrics(rt, args, device, config)
                print(training_line(args), flush=True)
            if args.save:
                every, steps, lineage = args.save_every, args.steps, run.lineage
                save = Saver(rt, args.save, every, steps, lineage, args.timeout)
            evaluation = evaluator(rt, args.eval_every, args.eval_steps, watchdog, metrics)
            after = [hook for hook in (save, evaluation) if hook]
            traces = train(
                rt,
                args.steps,
                handlers,
                watchdog,
                start=run.start,
                after_step=lambda step: [hook(step) for hook in after],
                report=metrics and (lambda fig: metrics.log(fig, save and save.writer.completed())),
            )
            done = max(rt.step, run.start)
            if done < args.steps:  # stopped by a signal: keep what was trained
                stopped(rt.grank, watchdog.signal_name, run.start, done, args.steps, save)
            else:
                skip = warmup_kept(args.skip, done - run.start, len(traces))
                write_measurements(rt, traces, skip)
            if grank == 0 and args.skip_nonfinite:
                print(f"skipped {rt.optimizer.skipped} non-finite steps", flush=True)
    except NonFinite as e:  # every rank found it in the same all-reduce: rank 0 says it
        if grank == 0:
            print(f"pipec runtime: {e}", file=sys.stderr, flush=True)
        code = 3
    except Exception as e:  # noqa: BLE001 - any failure: say where this rank was, then exit
        if os.environ.get("PIPEC_TRACEBACK"):  # for a bug report: where inside pipec it failed
            traceback.print_exc()
        said = (str(e).splitlines() or [""])[0]
        report(f"{watchdog.where()}: {type(e).__name__}: {said}", watchdog.step)
    if save is not None:  # a write still under way (a non-finite step ended the run)
        try:
            save.writer.wait()
        except PipecError as e:
            report(f"{watchdog.where()}: {e}", watchdog.step)
    if metrics:
        metrics.close()
    watchdog.stop()
    dist.destroy_process_group()
    # End now: the interpreter's teardown of torch's threads took seconds more here, which a
    # stopped run (torchrun waits for its ranks) must not spend.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_device(backend: str, share_gpu: bool, local_rank: int) -> torch.device:
    """Where a rank computes: its own GPU with NCCL; with --share-gpu, GPU local_rank modulo
    the node's GPUs (several ranks on each, over gloo); else the CPU."""
    if share_gpu:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")


def restore(rt: Rank, resume: Path | None, seed: int) -> int:
    """Load checkpoint `resume` (if any; preflight verified it) into this rank's stages (and a
    Trainer's masters and optimizer state), and open the data where it stopped; returns the
    step to continue from."""
    start = 0
    if resume and isinstance(rt.optimizer, Trainer):
        start = named_state.load(rt.optimizer, resume)
    elif resume:  # --check-grads: the weights only
        start = checkpoint.load(resume, rt.modules.values(), check=False)
    rt.data = open_source(rt.spec, rt.layout.m * rt.dp, seed, start)
    return start


def claim(run: Run, grank: int, device: torch.device) -> None:
    """Once every rank has joined: rank 0 takes the locks of the build and of --save
    (pipec/run_lock.py; held until the process ends) and, when the run resumes from a
    checkpoint of --save older than others there, starts a new branch (the later ones set
    aside, and said). When either fails, rank 0 says why and every rank exits 2, before
    anything is trained."""
    error = ""
    if grank == 0:
        try:
            run_lock.hold(run.build.path, run.save)
            if run.abandoned:
                branch(run)
        except PipecError as e:
            error = str(e)
        except OSError as e:
            error = os_error(e)
    error = all_gather_objects(error, device)[0]
    if error:
        if grank == 0:
            print(f"pipec runtime: {printable(error)}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(2)


def branch(run: Run) -> None:
    """Set aside the checkpoints of --save after the one `run` resumes from, and say so."""
    save = run.abandoned[0].parent
    aside = set_aside(save, list(run.abandoned), run.lineage)
    names = ", ".join(p.name for p in run.abandoned)
    print(
        f"pipec runtime: notice: resuming from step {run.start}, older than {names} in "
        f"{save}: a new branch; {names} moved to {aside} (kept, never resumed from again)",
        file=sys.stderr,
        flush=True,
    )


def check_grads(
    rt: Rank, run: Run, handlers: Mapping[Op, Handler], watchdog: Watchdog, seed: int
) -> bool:
    """One step, then every stage's gradients against the plain model's on the same batch, both
    with dropout off (`DropoutOff`); rank 0 prints one line per stage. True when a stage
    differs (on every rank)."""
    with DropoutOff():
        train(rt, run.start + 1, handlers, watchdog, start=run.start)
    model_plan = rt.build.plan["model"]
    plain = load_factory(run.spec, model_plan["seed"], model_plan.get("micro_batch_size"))
    if run.resume:
        checkpoint.load(run.resume, [plain.model])
    batches = open_source(plain, rt.layout.m * rt.dp, seed, run.start).next()
    with DropoutOff() as off:
        ref = reference_grads(plain.model, plain.loss_fn, batches, rt.device)
    checks = compare(rt.modules, rt.grank, rt.optimizer.grads, ref)
    everyone = all_gather_objects(checks, rt.device)
    found = sorted((c for cs in everyone for c in cs), key=lambda c: (c.stage, c.rank))
    bad = sorted({c.stage for c in found if c.error})
    if rt.grank == 0:
        print(
            f"check-grads: step {run.start + 1}, {len(batches)} micro-batches, against "
            "loss.backward() of the unsplit model (torch.testing.assert_close tolerances)",
            flush=True,
        )
        if off.dropped:
            print(
                f"check-grads: dropout off in both ({off.dropped} dropout calls with p > 0 "
                "ran with p = 0): the pipeline draws masks per stage and rank, not as one "
                "process does",
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


def training_line(args: argparse.Namespace) -> str:
    """What a run trains with, from its options: printed before its first step, so a log (or
    the docs' transcript of one) says which command made it."""
    saving = ""
    if args.save:
        every = f"every {args.save_every} steps and " if args.save_every else ""
        saving = f"; checkpoints to {args.save} {every}at the end"
    name = {"adamw": "AdamW", "sgd": "SGD"}.get(args.optimizer, args.optimizer)
    if args.optimizer_impl != "foreach":
        name += f" ({args.optimizer_impl})"
    return f"training to step {args.steps}: {name} lr {args.lr:g}, seed {args.seed}{saving}"


def _join(items: list[int]) -> str:
    return ", ".join(map(str, items))
