"""A run keeps the traces of its last `MEASURED_STEPS` steps only (a trace holds every
instruction's times and bytes: kept for every step, a long run's host memory would grow
without bound), and the warm-up steps it leaves out of the medians are counted from the
run's start, not the window's."""

from pathlib import Path

import torch
import torch.distributed as dist

from pipec.build_dir import emit, load
from pipec.model import compile_model
from pipec.runtime.faults import Watchdog
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.loop import train, warmup_kept
from pipec.runtime.rank import Rank

ROOT = Path(__file__).resolve().parents[1]


def test_train_keeps_only_the_last_steps_traces(tmp_path):
    out = tmp_path / "b"
    emit(compile_model(f"{ROOT}/tests/train_factories.py:copying", "interleaved", 1, 2), out)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen: list[int] = []
    try:
        rt = Rank.prepare(load(out), 0, 1, torch.device("cpu"))
        rt.connect(lambda ps: torch.optim.SGD(ps, lr=0.1), 30)
        with Watchdog(30, rt.describe) as watchdog:
            traces = train(rt, 5, HANDLERS, watchdog, lambda s, loss, t: seen.append(s), keep=2)
    finally:
        dist.destroy_process_group()
    assert rt.step == 5 and seen == [0, 1, 2, 3, 4]  # every step ran and was reported
    assert [t.full for t in traces] == [False, True]  # steps 4 and 5: only the last is full


def test_the_warm_up_is_counted_from_the_runs_start():
    assert warmup_kept(1, 30, 30) == 1  # all steps kept: the first is the warm-up
    assert warmup_kept(1, 30, 10) == 0  # the warm-up step fell out of the window
    assert warmup_kept(25, 30, 10) == 5  # steps 21-25 of the kept 21-30 are warm-up
    assert warmup_kept(40, 30, 10) == 9  # one step is always measured
