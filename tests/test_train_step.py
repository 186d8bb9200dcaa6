"""The optimizer step as large runs take it, against a plain one-process loop (ONE torchrun
launch of tests/train_worker.py, 2 ranks, the tiny GPT of tests/train_factories.py):

- fp32 with clipping, warm-up + cosine decay, weight decay on matrices only and AdamW betas:
  30 steps of 1f1b and of zb-v (the B/W split) give the plain loop's losses, learning rates
  and gradient norms (torch's clip_grad_norm_, torch.optim.AdamW with the two groups);
- bf16 against the plain loop with the same policy (bf16 model, fp32 master weights, gradients
  accumulated per micro-batch in fp32);
- a run killed at step 4 (mid-warm-up) or 8 (mid-decay) and resumed continues the same losses;
- a loss that turns NaN at step 5 stops `pipec run` before the step, one line, exit 3; with
  --skip-nonfinite the run skips it and finishes;
- bad options are refused in one line, exit 2, before any rank joins a process group.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipec import checkpoint
from pipec.build_dir import emit
from pipec.model import compile_model
from pipec.runtime.torchrun import torchrun
from tests.plain_loop import plain_loop
from tests.runtime_launch import launch, refused

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train_worker.py"
DATA = f"{ROOT}/tests/train_factories.py:copying"
NAN = f"{ROOT}/tests/train_factories.py:nan_at_step_5"
P, M, LR, STEPS, BF16_STEPS = 2, 4, 1e-2, 30, 8
OPTIONS = {
    "max_norm": 0.5,
    "warmup": 5,
    "decay": "cosine",
    "min_lr": 1e-3,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def builds():
    return {f: compile_model(DATA, f, P, M) for f in ("1f1b", "zb-v")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, builds):
    tmp = tmp_path_factory.mktemp("train-step")
    ck = tmp / "ck"

    def run(build, n=STEPS, save=None, resume=None, **extra):
        options = OPTIONS | extra
        return builds[build], {
            "steps": n,
            "lr": LR,
            "save": save and str(ck),
            "every": 4,
            "resume": resume and str(checkpoint.step_dir(ck, resume)),
            "full_loss": None,
            "options": options,
        }

    cases = {
        "1f1b": run("1f1b"),
        "zb-v": run("zb-v"),
        "bf16/1f1b": run("1f1b", BF16_STEPS, precision="bf16"),
        "bf16/zb-v": run("zb-v", BF16_STEPS, precision="bf16"),  # W into fp32 main_grad
        # killed after step 8 of a 30-step schedule: checkpoints at 4 and 8
        "killed": run("zb-v", 8, save=True, steps=STEPS),
        "from-4": run("1f1b", 12, resume=4, steps=STEPS),
        "from-8": run("zb-v", 12, resume=8, steps=STEPS),
    }
    launched = launch(cases, P, tmp, timeout=420, script=WORKER)
    return launched.results[0]


@pytest.fixture(scope="module")
def plain():
    return plain_loop(DATA, STEPS, M, LR, OPTIONS)


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_fp32_equals_the_plain_loop_with_clipping_schedule_and_groups(runs, plain, name):
    got = runs[name]
    torch.testing.assert_close(got["losses"], plain["losses"], rtol=1e-5, atol=0)
    lrs = [n["lr"] for n in got["numbers"]]
    norms = [n["grad_norm"] for n in got["numbers"]]
    torch.testing.assert_close(lrs, plain["lr"], rtol=1e-12, atol=0)
    torch.testing.assert_close(norms, plain["grad_norm"], rtol=1e-5, atol=0)
    assert not any(n["skipped"] for n in got["numbers"])
    assert sum(n > OPTIONS["max_norm"] for n in norms) > STEPS // 2  # clipping did act


@pytest.fixture(scope="module")
def plain_bf16():
    return plain_loop(DATA, BF16_STEPS, M, LR, OPTIONS, bf16=True)


@pytest.mark.parametrize("name", ["bf16/1f1b", "bf16/zb-v"])
def test_bf16_equals_the_plain_loop_with_the_same_policy(runs, plain_bf16, name):
    want, got = plain_bf16, runs[name]
    torch.testing.assert_close(got["losses"], want["losses"], rtol=2e-3, atol=0)
    # and differs from fp32 (it did compute in bf16)
    assert got["losses"] != runs["1f1b"]["losses"][:BF16_STEPS]


@pytest.mark.parametrize("name, start", [("from-4", 4), ("from-8", 8)])
def test_a_run_resumed_mid_warmup_or_mid_decay_continues_the_curve(runs, plain, name, start):
    got = runs[name]
    assert got["start"] == start
    torch.testing.assert_close(got["losses"], plain["losses"][start:12], rtol=1e-5, atol=0)
    torch.testing.assert_close(
        [n["lr"] for n in got["numbers"]], plain["lr"][start:12], rtol=1e-12, atol=0
    )


def test_the_nonfinite_guard_stops_before_the_step_or_skips_it(tmp_path):
    build = tmp_path / "build"
    emit(compile_model(NAN, "1f1b", P, M), build)
    env = torchrun(build / "launch.py", 1)[1]
    base = [sys.executable, "-m", "pipec", "run", str(build), "--threads", "1", "--steps", "7"]

    def pipec_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*base, *args], env=env, capture_output=True, text=True, timeout=300, check=False
        )

    ck = tmp_path / "ck"
    stopped = pipec_run("--save", str(ck), "--save-every", "4")
    assert stopped.returncode == 3, stopped.stderr[-2000:]
    said = [line for line in stopped.stderr.splitlines() if line.startswith("pipec runtime:")]
    assert len(said) == 1, said  # rank 0's one line (and `pipec run` repeats it last)
    assert said[0].startswith("pipec runtime: step 5: the loss is not finite (stage 1"), said
    assert sorted(map(int, re.findall(r"step +(\d+)/7", stopped.stdout))) == [1, 2, 3, 4]
    assert [p.name for p in checkpoint.checkpoints(ck)] == ["step_000004"]
    skipped = pipec_run("--skip-nonfinite")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "skipped 1 non-finite steps" in skipped.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--max-norm", "-1"], "--max-norm -1: the norm to clip to must be positive"),
        (["--steps", "10", "--warmup", "10"], "--warmup 10 with --steps 10"),
        (["--betas", "2"], "'2' is not two numbers"),
        (["--zero", "1"], "--zero 1 shards the optimizer over data-parallel copies"),
    ],
)
def test_bad_training_options_are_refused_before_any_rank_starts(
    builds, tmp_path, monkeypatch, capsys, args, said
):
    emit(builds["1f1b"], tmp_path / "build")
    err = refused(tmp_path / "build", monkeypatch, capsys, *args, world=P)
    assert said in err, err
