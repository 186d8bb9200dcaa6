"""Bench scripts run as documented (`PYTHONPATH=$PWD python bench/X.py`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the benchmark")
def test_attention_bench_without_cuda_says_it_skipped():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = [sys.executable, "bench/attention.py"]
    proc = subprocess.run(script, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped: needs a CUDA GPU" in proc.stdout


def test_precision_bench_runs_or_names_the_missing_option():
    """bench/precision.py --help works; without launch.py --precision it says so, exit 2
    (its runs take minutes: not run here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "bench/precision.py", "--steps", "0"]
    kw = {"cwd": ROOT, "env": env, "capture_output": True, "text": True}
    helped = subprocess.run([*run, "--help"], check=False, **kw)
    assert helped.returncode == 0 and "fp32 against bf16" in helped.stdout
    from pipec.runtime.options import launch_parser

    if "--precision" not in {s for a in launch_parser()._actions for s in a.option_strings}:
        proc = subprocess.run(run, check=False, **kw)
        assert proc.returncode == 2 and "has no --precision option yet" in proc.stderr
