"""Training runs inside ONE torchrun launch, for tests/test_train.py (a launch costs ~5 s).

    torchrun --standalone --nproc-per-node 4 tests/train_worker.py RUNS.json RESULTS_DIR

RUNS.json lists {"name", "build", "steps", "lr", "save": DIR | null, "every": K,
"resume": CHECKPOINT | null, "full_loss": CHECKPOINT | null, "options": {...}}, run in order (a
resumed run may name a checkpoint an earlier run wrote); "options" are runtime/optim.py's
TrainOptions fields and the Schedule's (warmup, decay, min_lr, decay_fraction; "steps": the
schedule's length when a run stops before it, as a killed run would), default none.
Each run does what launch.py does (the Trainer, restore, train with a `Saver`, the same runtime
functions) and writes to RESULTS_DIR/<rank>.json: the loss of each step (rank 0), each
optimizer step's figures, the bytes of the optimizer's masters and state, whether this rank read
the data, and with "full_loss" the loss of the plain model loaded with
`pipec.checkpoint.load_full` on the batch the run's first step used.
"""

from pipec.runtime.faults import take_termination_signals

take_termination_signals()  # before torch starts threads, as launch.py does

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from pipec import checkpoint
from pipec.build_dir import load
from pipec.frontend import load_factory
from pipec.frontend.precision import PRECISIONS
from pipec.runtime.checkpoint_hooks import restore
from pipec.runtime.data import open_source
from pipec.runtime.faults import Watchdog
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.loop import train
from pipec.runtime.lr import Schedule
from pipec.runtime.optim import Trainer, TrainOptions
from pipec.runtime.rank import Rank
from pipec.runtime.saving import Saver
from pipec.runtime.stash import tensors_nbytes
from tests.runtime_harness import TIMEOUT_S, serve


def full_loss(spec: str, seed: int, path: Path, step: int, n: int) -> float:
    """The plain model loaded from checkpoint `path`: its mean loss on global batch `step`."""
    ms = load_factory(spec, seed)
    checkpoint.load_full(path, ms.model)
    with torch.no_grad():
        batches = open_source(ms, n, 0, step).next()
        return sum(ms.loss_fn(ms.model(*x), y).item() for x, y in batches) / n


def train_options(lr: float, steps: int, given: dict) -> TrainOptions:
    """A case's options: the schedule's fields and TrainOptions' (betas as a list)."""
    fields = {f.name for f in dataclasses.fields(Schedule)}
    # "steps" in the options: the schedule's length, for a run stopped before its end
    schedule = Schedule(lr, **{"steps": steps} | {k: v for k, v in given.items() if k in fields})
    rest = {k: tuple(v) if k == "betas" else v for k, v in given.items() if k not in fields}
    return TrainOptions(schedule, **rest)


def run(case: dict, watchdog: Watchdog) -> dict:
    build = load(Path(case["build"]))
    dtype = PRECISIONS[case.get("options", {}).get("precision", "fp32")]
    rt = Rank.prepare(
        build, dist.get_rank(), dist.get_world_size(), torch.device("cpu"), None, 0, dtype
    )
    read = []
    if rt.spec.data is not None:  # note whether the runtime asks this rank for data

        def data(rows: int, start: int):  # type: ignore[no-untyped-def]
            read.append(start)
            return rt_data(rows, start)

        rt_data = rt.spec.data
        rt = dataclasses.replace(rt, spec=dataclasses.replace(rt.spec, data=data))
    watchdog.describe = rt.describe
    options = train_options(case["lr"], case["steps"], case.get("options", {}))
    rt.connect(lambda _: Trainer(rt, options), TIMEOUT_S)
    resume = Path(case["resume"]) if case["resume"] else None
    start = restore(rt, resume, 0)
    losses: list[float] = []
    numbers: list[dict] = []
    save = None
    if case["save"]:
        save = Saver(rt, Path(case["save"]), case["every"], case["steps"], timeout=TIMEOUT_S)

    def after_step(step: int) -> None:
        numbers.append(dataclasses.asdict(rt.step_state.numbers()))
        if save:
            save(step)

    train(
        rt,
        case["steps"],
        HANDLERS,
        watchdog,
        lambda s, loss, t: losses.append(loss),
        start,
        after_step,
    )
    optimizer_bytes = tensors_nbytes(rt.optimizer.tensors())
    result = {"losses": losses, "start": start, "read": bool(read), "numbers": numbers}
    result |= {"optimizer_bytes": optimizer_bytes}
    if case.get("full_loss") and dist.get_rank() == 0:
        model = build.plan["model"]
        n = rt.layout.m * rt.dp
        result["full_loss"] = full_loss(model["spec"], model["seed"], case["full_loss"], start, n)
    return result


if __name__ == "__main__":
    serve(run)
