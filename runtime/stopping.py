"""How a rank's run ends: stopped by a signal after a step (a last checkpoint, one line), ended
by a failure (one line saying where this rank was), or done; then the checkpoint still being
written is waited for and the process ends at once (runtime/faults.py takes the signals)."""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

from pipec import checkpoint
from pipec.ir import PipecError
from pipec.runtime.faults import Watchdog, report
from pipec.runtime.metrics import Metrics
from pipec.runtime.optim import NonFinite
from pipec.runtime.saving import Saver

#: The exit code of a run stopped by a non-finite loss or gradient norm.
EXIT_NONFINITE = 3


def stopped(
    grank: int, signal_name: str, start: int, done: int, steps: int, save: Saver | None
) -> None:
    """After a stop signal: a last checkpoint of the `done` steps, complete before this
    returns (unless step `done` was just saved, or the run trained nothing since step
    `start`), and rank 0's line saying where the run stopped."""
    kept = ""
    if save is not None:
        if save.saved_step != done and done > start:
            save(done, force=True)
        save.writer.wait()
        if save.saved_step == done:
            kept = f"; checkpoint {checkpoint.step_dir(save.writer.directory, done)}"
    if grank == 0:
        print(
            f"pipec runtime: stopped by {signal_name} after step {done} of {steps}{kept}",
            file=sys.stderr,
            flush=True,
        )


def failed(error: Exception, grank: int, watchdog: Watchdog) -> int:
    """The exit code of a run that `error` ended (called where it was caught). A non-finite
    step, which every rank found in the same all-reduce: rank 0 says it, exit 3. Anything
    else: this rank says where it was and ends now (`report`)."""
    if isinstance(error, NonFinite):
        if grank == 0:
            print(f"pipec runtime: {error}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    if os.environ.get("PIPEC_TRACEBACK"):  # for a bug report: where inside pipec it failed
        traceback.print_exc()
    said = (str(error).splitlines() or [""])[0]
    report(f"{watchdog.where()}: {type(error).__name__}: {said}", watchdog.step)


def finish(code: int, watchdog: Watchdog, save: Saver | None, metrics: Metrics | None) -> None:
    """End the process with `code` once a checkpoint still being written is complete (a
    non-finite step ended the run while one was) and the metrics are closed."""
    if save is not None:
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
