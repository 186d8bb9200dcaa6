"""ZeRO-1 in ONE torchrun launch of tests/train_worker.py (4 ranks, the tiny GPT): `--zero 1`
at p=2 x D=2 trains as plain data parallelism does (same losses and norms), with half the
optimizer state per rank, and its checkpoints are keyed by parameter name: a ZeRO checkpoint
resumes in a p=4 build without data parallelism, and that build's checkpoint under ZeRO."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipec import checkpoint
from pipec.model import compile_model
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train_worker.py"
DATA = f"{ROOT}/tests/train_factories.py:copying"
LR, STEPS, EVERY = 1e-2, 8, 4
OPTIONS = {"max_norm": 0.5, "warmup": 2, "decay": "cosine", "weight_decay": 0.1}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-zero")
    builds = {
        "dp2": compile_model(DATA, "1f1b", 2, 2, dp=2),
        "p4": compile_model(DATA, "1f1b", 4, 4),
    }

    def run(build, n=STEPS, save=None, resume=None, **extra):
        return builds[build], {
            "steps": n,
            "lr": LR,
            "save": save and str(tmp / save),
            "every": EVERY,
            "resume": resume and str(checkpoint.step_dir(tmp / resume, EVERY)),
            "full_loss": None,
            "options": OPTIONS | extra,
        }

    cases = {
        "dp2": run("dp2"),
        "zero": run("dp2", save="ck-zero", zero=True),
        "zero-to-p4": run("p4", resume="ck-zero"),
        "p4": run("p4", save="ck-p4"),
        "p4-to-zero": run("dp2", resume="ck-p4", zero=True),
    }
    return launch(cases, 4, tmp, timeout=420, script=WORKER).results


def test_zero_trains_as_data_parallelism_with_half_the_optimizer_state(runs):
    dp2, zero = runs[0]["dp2"], runs[0]["zero"]
    torch.testing.assert_close(zero["losses"], dp2["losses"], rtol=1e-6, atol=0)
    norms = [[n["grad_norm"] for n in r["numbers"]] for r in (zero, dp2)]
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
    for rank in range(4):
        full, sharded = runs[rank]["dp2"]["optimizer_bytes"], runs[rank]["zero"]["optimizer_bytes"]
        assert 0.45 < sharded / full < 0.55, (rank, sharded, full)


@pytest.mark.parametrize("resumed, uninterrupted", [("zero-to-p4", "dp2"), ("p4-to-zero", "p4")])
def test_checkpoints_move_between_zero_and_no_data_parallelism(runs, resumed, uninterrupted):
    got, want = runs[0][resumed], runs[0][uninterrupted]
    assert got["start"] == EVERY
    torch.testing.assert_close(got["losses"], want["losses"][EVERY:], rtol=1e-5, atol=0)
