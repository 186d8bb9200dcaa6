"""The checks every rank of a run makes alike before it talks to another: their verdict is the
same on every rank, so rank 0 says it in one line and every rank exits 2 (runtime/main.py).

The backend and the GPUs it needs, the build read and verified, the world size, the model's
factory found and still matching the plan, the checkpoint to resume from and its contents, and
the --save directory's lineage.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pipec import checkpoint
from pipec.build_dir import Build, check_build, load
from pipec.checkpoint_lineage import Lineage, check_save, later_than
from pipec.frontend import FrontendError, load_factory
from pipec.ir import PipecError
from pipec.provenance import check_model, resolve
from pipec.run_checks import check_writable
from pipec.runtime.config import LaunchConfig, RunConfig
from pipec.runtime.rank import check_runnable
from pipec.runtime.restart import attempt, resume_from, run_id


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


def check_backend(run: RunConfig, local_world: int) -> None:
    """Refuse a backend this machine cannot run: NCCL or --share-gpu without CUDA, NCCL with
    more ranks on the node than GPUs, --share-gpu over NCCL."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if run.share_gpu:
        if run.backend == "nccl":
            raise PipecError(
                "--share-gpu runs on gloo: NCCL refuses two ranks on one GPU; drop --backend nccl"
            )
        if gpus == 0:
            raise PipecError(
                "--share-gpu needs CUDA, and torch sees no GPU here; drop it to run on CPU"
            )
    elif run.backend == "nccl":
        if gpus == 0:
            raise PipecError("--backend nccl needs CUDA, and torch sees no GPU here; use gloo")
        if local_world > gpus:
            raise PipecError(
                f"--backend nccl: {local_world} ranks on this node but {gpus} GPUs; "
                f"launch at most {gpus} per node"
            )


def preflight(
    build_dir: Path, config: LaunchConfig, world: int, local_world: int, say: bool = True
) -> Run:
    """The checks whose verdict is the same on every rank; PipecError names the defect. `say`:
    this rank prints the notices (a damaged newest checkpoint skipped). Changes nothing on
    disk but the probe of --save: a rollback's branch is `claim`'s, after every rank joined."""
    run, ck = config.run, config.checkpoint
    check_backend(run, local_world)
    build = load(build_dir)
    if not run.no_verify:
        try:
            check_build(build)
        except PipecError as e:
            raise PipecError(
                f"{build.path} fails verification: {e} (recompile; --no-verify skips this check)"
            ) from None
    check_runnable(build, world)
    if error := config.training.zero_error(int(build.plan.get("dp", 1))):
        raise PipecError(error)
    model_plan = build.plan["model"]
    spec = resolve(model_plan, run.model, build.path)
    try:
        factory = load_factory(spec, model_plan["seed"], model_plan.get("micro_batch_size"))
    except FrontendError as e:
        raise PipecError(f"{e}; pass --model path/to/file.py:factory if it moved") from None
    check_model(factory.model, model_plan, spec)
    if ck.save:
        check_writable(ck.save)  # now, not after training
    every = config.eval.eval_every
    if every and factory.eval_data is None and not run.check_grads:
        raise PipecError(
            f"--eval-every {every}: the ModelSpec of {spec} has no eval_data; give it "
            "eval_data (batches in the form of data) or drop --eval-every"
        )
    resume, start = None, 0
    this_run = run_id()
    given = resume_from(ck.save, ck.resume, this_run) if attempt() else ck.resume
    if given:
        resume, skipped = checkpoint.newest_intact(given)
        if say:
            for line in skipped:
                print(f"pipec runtime: notice: {line}", file=sys.stderr, flush=True)
        checkpoint.check_fits(resume, factory.model)
        start = checkpoint.saved_step(resume)
        steps = config.training.steps
        if start >= steps and not run.check_grads:
            raise PipecError(
                f"{resume} is at step {start} and --steps is {steps}: nothing to train; "
                "--steps counts from the first step, raise it"
            )
    lineage = Lineage.new(build.plan, build.plan_hash, resume, this_run)
    if not ck.save or run.check_grads:  # --check-grads saves nothing
        return Run(build, spec, resume, start, lineage)
    check_save(ck.save, given, lineage)
    later = later_than(ck.save, resume) if resume else []
    return Run(build, spec, resume, start, lineage, Path(ck.save), tuple(later))


def rank_device(backend: str, share_gpu: bool, local_rank: int) -> torch.device:
    """Where a rank computes: its own GPU with NCCL; with --share-gpu, GPU local_rank modulo
    the node's GPUs (several ranks on each, over gloo); else the CPU."""
    if share_gpu:
        return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    return torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
