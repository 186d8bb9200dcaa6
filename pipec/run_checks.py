"""What `pipec run` checks before it starts torchrun, so that a bad option costs no launch.

The launch options are parsed by launch.py's own parser (runtime/options.py), so every option
the runtime knows is checked here the same way, in one line; the build must load (a corrupted
plan.json or program is named), its launch.py and model factory must be the plan's (pipec run
executes them), `--nproc` must be the build's P·D ranks, `--max-restarts` must have checkpoints
to restart from (`--save`), no other run may be running the build
or saving into `--save` (pipec/run_lock.py), and a `--save` directory must take a file (a
probe, written and removed) and hold no checkpoints of another model, build or run
(pipec/checkpoint_lineage.py) before any rank trains.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipec.ir import PipecError
from pipec.progress import progress

if TYPE_CHECKING:
    from pipec.runtime.config import LaunchConfig


def launch_options(args: Sequence[str]) -> LaunchConfig | None:
    """`args` parsed as launch.py would, the run's config; PipecError with argparse's message
    in one line.
    None for `--help` (printed here; there is nothing to run)."""
    # launch.py's own parser, so options added to it are checked here too (torch: only now).
    from pipec.runtime.options import parse_launch

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_launch(list(args))
    except SystemExit as e:
        if not e.code:
            return None
        said = [line for line in err.getvalue().splitlines() if line.strip()]
        reason = said[-1].removeprefix("launch.py: error: ") if said else "bad launch options"
        reason = reason.removesuffix(" (launch.py --help lists them)")  # said once, below
        raise PipecError(f"launch option: {reason}; BUILD/launch.py --help lists them") from None


def check_writable(directory: Path, option: str = "--save") -> None:
    """Raise PipecError unless files can be written in `directory` (created if missing)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise PipecError(f"{option} {directory} is a file; name a directory for the checkpoints")
    probe = directory / f".pipec-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PipecError(
            f"{option} {directory}: cannot write there ({e.strerror}); choose a writable directory"
        ) from None


def check_run(
    build: Path, nproc: int | None, args: Sequence[str], max_restarts: int = 0
) -> tuple[int, LaunchConfig] | None:
    """Every check `pipec run BUILD [--nproc N] [--max-restarts N] ARGS` makes before starting
    torchrun; returns the number of ranks to start and the launch options, or None when only
    `--help` was asked for."""
    from pipec.build_dir import check_launch, load
    from pipec.checkpoint_lineage import Lineage, check_save
    from pipec.provenance import check_factory, resolve
    from pipec.run_lock import check_free

    if not (Path(build) / "launch.py").is_file():
        raise PipecError(
            f"{build}: no launch.py here; compile a model with `pipec compile MODEL ... --out DIR`"
        )
    loaded = load(build)
    ranks = loaded.compiled.world * int(loaded.plan.get("dp", 1))
    if nproc is not None and nproc != ranks:
        raise PipecError(
            f"--nproc {nproc}: this build runs {ranks} ranks, all on this machine; drop --nproc"
        )
    config = launch_options(args)
    if config is None:
        return None
    run, ck, precision = config.run, config.checkpoint, config.training.precision
    check_restarts(max_restarts, config)
    if error := config.training.zero_error(int(loaded.plan.get("dp", 1))):
        raise PipecError(error)
    check_launch(loaded)  # pipec run executes it: it must be the plan's
    model_plan = loaded.plan.get("model")
    if model_plan is not None and run.model is None:
        check_factory(model_plan, loaded.path)
    saves = ck.save is not None and not run.check_grads  # --check-grads saves nothing
    check_free(loaded.path, ck.save if saves else None)
    if ck.save is not None:
        check_writable(ck.save)
    if saves:
        check_save(ck.save, ck.resume, Lineage.new(loaded.plan, loaded.plan_hash, None))
    if model_plan is None:
        return ranks, config
    every = config.eval.eval_every
    if every and not run.check_grads and model_plan.get("eval_data") is False:
        raise PipecError(
            f"--eval-every {every}: the ModelSpec of {model_plan['spec']} has no "
            "eval_data; give it eval_data (batches in the form of data) or drop --eval-every"
        )
    if precision != "fp32" and loaded.plan.get("precision", "fp32") != precision:
        spec = resolve(model_plan, run.model, loaded.path)
        check_trains_at(spec, model_plan, precision)
    return ranks, config


def check_restarts(max_restarts: int, config: LaunchConfig) -> None:
    """Refuse `--max-restarts N` where a restart could not resume the run: N below 0, no
    --save (a restarted rank resumes from its newest checkpoint), --check-grads (one step,
    nothing saved)."""
    if max_restarts < 0:
        raise PipecError(f"--max-restarts {max_restarts}: give 0 (no restart) or more")
    if max_restarts and config.run.check_grads:
        raise PipecError(
            "--max-restarts: --check-grads runs one step and saves nothing; drop --max-restarts"
        )
    if max_restarts and config.checkpoint.save is None:
        raise PipecError(
            f"--max-restarts {max_restarts}: a restarted run resumes from the newest checkpoint "
            "of --save DIR; give --save DIR (and --save-every K)"
        )


def check_trains_at(spec: str, model_plan: dict, precision: str) -> None:
    """Refuse, naming the op, a model that cannot train at `precision`: every stage built at it
    as the ranks build theirs, one micro-batch forward and backward (`build_stages`). A build
    compiled with `--precision` was checked when compiled."""
    from pipec.frontend import FrontendError, build_stages
    from pipec.frontend.precision import PRECISIONS

    stages = list(range(model_plan["n_stages"]))
    with progress(f"checking that {spec} trains at {precision}"):
        try:
            build_stages(spec, model_plan, stages, dtype=PRECISIONS[precision], check_backward=True)
        except FrontendError as e:
            raise PipecError(str(e)) from None
