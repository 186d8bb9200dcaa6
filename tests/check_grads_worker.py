"""`launch.py --check-grads` for many builds in ONE torchrun launch (see tests/runtime_harness.py).

    torchrun --standalone --nproc-per-node P tests/check_grads_worker.py CASES.json RESULTS_DIR

For each case ({"name", "build"}) every rank rebuilds its stages and runs
`runtime.gradcheck.check_grads` as launch.py does (one step, its reference, dropout off in both);
rank 0's printed report and the verdict go to RESULTS_DIR/<rank>.json.
"""

from pipec.runtime.faults import take_termination_signals

take_termination_signals()  # before torch starts threads, as launch.py does

import io
from contextlib import redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist

from pipec.build_dir import load
from pipec.checkpoint_lineage import Lineage
from pipec.runtime.checkpoint_hooks import restore
from pipec.runtime.faults import Watchdog
from pipec.runtime.gradcheck import GradCapture, check_grads
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.preflight import Run
from pipec.runtime.rank import Rank
from tests.runtime_harness import TIMEOUT_S, serve


def run_case(case: dict, watchdog: Watchdog) -> dict:
    build = load(Path(case["build"]))
    rt = Rank.prepare(build, dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    watchdog.describe = rt.describe
    rt.connect(GradCapture, TIMEOUT_S)
    restore(rt, None, 0)
    printed = io.StringIO()
    with redirect_stdout(printed):
        lineage = Lineage.new(build.plan, build.plan_hash, None)
        run = Run(build, build.plan["model"]["spec"], None, 0, lineage)
        failed = check_grads(rt, run, HANDLERS, watchdog, 0)
    return {"ok": not failed, "stdout": printed.getvalue()}


if __name__ == "__main__":
    serve(run_case)
