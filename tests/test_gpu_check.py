"""`make gpu-check` (bench/gpu_check.py): without CUDA it names every step it skipped and exits
0; each step's outcome and figure lines come from the command's own exit code and output."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench/gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # for @dataclass
spec.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run every step")
def test_make_gpu_check_without_cuda_skips_every_step_and_exits_0():
    proc = subprocess.run(
        ["make", "-s", "gpu-check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "gpu_check: torch sees no CUDA GPU here; skipped every step:"
    skipped = [line.split()[0] for line in lines[1:]]
    assert skipped == [s.name for s in gpu_check.steps(ROOT)]
    for s in gpu_check.steps(ROOT):  # a piece not built yet is named as such
        missing = s.script is not None and not (ROOT / s.script).is_file()
        assert missing == (f"({s.script} does not exist in this checkout yet)" in proc.stdout)


def test_an_unknown_step_is_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--only", "kernel-speed,warp"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("gpu_check: --only warp: no such step; steps: kernel-tests,")


def step(code: str, figures: str):
    """A step running `code` in Python, quoting the lines that match `figures`."""
    return gpu_check.Step("t", "a test step", (sys.executable, "-c", code), figures)


def test_a_step_reports_its_exit_code_and_its_figure_lines(capsys):
    code = "print('warming up'); print('ratio 0.93'); print('ratio 1.02')"
    outcome, figures = gpu_check.run(step(code, r"^ratio"))
    assert outcome.startswith("ok, ") and figures == ["ratio 0.93", "ratio 1.02"]
    assert "warming up" in capsys.readouterr().out  # the output streams through
    outcome, _ = gpu_check.run(step("import sys; print('ratio 2'); sys.exit(3)", "ratio"))
    assert outcome.startswith("FAILED (exit 3)")


def test_an_empty_pytest_selection_is_a_skip_not_a_failure(tmp_path):
    (tmp_path / "test_none.py").write_text("def test_cpu():\n    pass\n")
    argv = (sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tmp_path / "test_none.py"))
    outcome, _ = gpu_check.run(gpu_check.Step("t", "no gpu tests", argv, "passed"))
    assert outcome.startswith("skipped: no test selected yet")
