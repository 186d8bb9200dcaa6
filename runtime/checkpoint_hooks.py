"""What a run does with checkpoints around its training: load the one it resumes from
(`restore`), claim the build and --save once every rank has joined (`claim`: the locks, and a
rollback's new branch), and save after the steps that save (`saver`, runtime/saving.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipec import checkpoint, run_lock
from pipec.build_dir import os_error
from pipec.checkpoint_lineage import set_aside
from pipec.ir import PipecError
from pipec.runtime import named_state
from pipec.runtime.config import LaunchConfig
from pipec.runtime.data import open_source
from pipec.runtime.gather import all_gather_objects
from pipec.runtime.optim import Trainer
from pipec.runtime.preflight import Run
from pipec.runtime.rank import Rank
from pipec.runtime.saving import Saver
from pipec.terminal import printable


def restore(rt: Rank, resume: Path | None, seed: int) -> int:
    """Load checkpoint `resume` (if any; preflight verified it) into this rank's stages (and a
    Trainer's masters and optimizer state), and open the data where it stopped; returns the
    step to continue from."""
    start = 0
    if resume and isinstance(rt.optimizer, Trainer):
        start = named_state.load(rt.optimizer, resume)
    elif resume:  # --check-grads: the weights only
        start = checkpoint.load(resume, rt.modules.values(), check=False)
    rt.open_data(open_source(rt.spec, rt.layout.m * rt.dp, seed, start))
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


def saver(rt: Rank, config: LaunchConfig, run: Run) -> Saver | None:
    """The hook that saves after a step, when the run saves (--save)."""
    ck = config.checkpoint
    if not ck.save:
        return None
    steps, timeout = config.training.steps, config.run.timeout
    return Saver(rt, ck.save, ck.save_every, steps, run.lineage, timeout)
