"""`make gpu-check` (bench/gpu_check.py): without CUDA it names every step it skipped and exits
0; each step's outcome and figure lines come from the command's own exit code and output; every
step's script is in the checkout (the shared-GPU pipeline and CUDA memory benches skip without
CUDA), the summary quotes the rows they print, and the runtime-cuda step selects the runtime's
shared-GPU tests."""

import importlib.util
import os
import re
import subprocess
import sys
import time
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


def test_a_step_past_its_limit_is_stopped_with_its_children_and_fails(tmp_path):
    """A hung step (here a child process sleeping) cannot spend the GPU session: the whole
    process group is stopped at the limit and the step reported as failed."""
    pid_file = tmp_path / "child.pid"
    child = tmp_path / "child.py"
    child.write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    code = (
        "import os, subprocess, sys, time\n"
        f"proc = subprocess.Popen([sys.executable, {str(child)!r}])\n"
        f"while not os.path.exists({str(pid_file)!r}): time.sleep(0.05)\n"
        "print('ratio 1', flush=True)\nproc.wait()\n"
    )
    outcome, figures = gpu_check.run(step(code, "ratio"), limit_s=6)
    assert outcome == "FAILED (stopped at its limit, 6 s)" and figures == ["ratio 1"]
    pid = int(pid_file.read_text())
    for _ in range(100):  # SIGKILL lands at once; the state changes a moment later
        if dead(pid):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {pid} outlived the step")


def dead(pid: int) -> bool:
    """Gone, or a zombie (killed, its parent not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_quick_adds_each_steps_own_arguments(capsys):
    by_name = {s.name: s for s in gpu_check.steps(ROOT)}
    assert by_name["kernel-speed"].quick == ("--seqs", "4096")
    assert by_name["runtime-4"].quick == ("--quick",)
    outcome, _ = gpu_check.run(
        gpu_check.Step(
            "t",
            "echo",
            (sys.executable, "-c", "import sys; print(sys.argv)"),
            "x",
            quick=("--fast",),
        ),
        quick=True,
    )
    assert outcome.startswith("ok") and "'--fast'" in capsys.readouterr().out


def test_an_empty_pytest_selection_is_a_skip_not_a_failure(tmp_path):
    (tmp_path / "test_none.py").write_text("def test_cpu():\n    pass\n")
    argv = (sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(tmp_path / "test_none.py"))
    outcome, _ = gpu_check.run(gpu_check.Step("t", "no gpu tests", argv, "passed"))
    assert outcome.startswith("skipped: no test selected yet")


def load_bench(name: str):  # type: ignore[no-untyped-def]
    """bench/NAME.py as a module (bench/ scripts import each other by name)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"bench/{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_step_is_runnable_from_this_checkout():
    """The shared-GPU pipeline and the CUDA memory figures have their scripts: on the GPU
    machine no step is skipped for a missing piece."""
    assert [s.name for s in gpu_check.steps(ROOT) if s.missing()] == []
    assert {"bench/gpu_pipeline.py", "bench/cuda_memory.py"} <= {
        s.script for s in gpu_check.steps(ROOT)
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the benchmark")
@pytest.mark.parametrize("script", ["gpu_pipeline", "cuda_memory"])
def test_the_gpu_benches_without_cuda_say_they_skipped(script):
    proc = subprocess.run(
        [sys.executable, f"bench/{script}.py"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        proc.stdout
        == f"{script}: skipped: needs a CUDA GPU and torch sees none; nothing measured\n"
    )


HEADER = "NVIDIA H100, 4 ranks sharing it (--share-gpu), gpt.py:tiny, m=8"


def test_the_summary_quotes_the_rows_the_benches_print():
    steps = {s.name: s for s in gpu_check.steps(ROOT)}
    pipeline, memory = load_bench("gpu_pipeline"), load_bench("cuda_memory")
    stats = {
        "measured": {"makespan_ms": 12.5},
        "simulated": {"makespan_ms": 10.0},
        "ranks": [{"busy_ms": 3.0}] * 4,
    }
    lines = {
        "pipeline-cuda": [
            f"gpu_pipeline: {HEADER}, 20 steps, figures of steps 2..",
            pipeline.row("1f1b --evict", stats, "ok"),
        ],
        "cuda-memory": [
            f"cuda_memory: {HEADER}, 4 steps, figures of steps 2..",
            memory.row("v-half", 3, 4 * 2**20, 4 * 2**20 - 2**16),
            "real/predicted peak over every rank: 0.990 to 1.020",
        ],
    }
    for name, (header, *figures) in lines.items():
        quoted = [line for line in [header, *figures] if re.search(steps[name].figures, line)]
        assert quoted == figures, name
    assert "measured/simulated  1.25" in lines["pipeline-cuda"][1]
    assert "real/predicted 1.016" in lines["cuda-memory"][1]


def test_the_runtime_cuda_step_selects_the_shared_gpu_runtime_tests():
    """tests/test_runtime_cuda.py is marked gpu and lies where the step's selection looks: ranks
    sharing the GPU, and NCCL with a GPU per rank (run where there are two GPUs or more)."""
    step = next(s for s in gpu_check.steps(ROOT) if s.name == "runtime-cuda")
    assert "tests" in step.argv and "--ignore=tests/test_runtime_cuda.py" not in step.argv
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu",
         "-p", "no:cacheprovider", "tests/test_runtime_cuda.py"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    schedules = ["1f1b", "zb-v", "v-half", "bitpipe", "1f1b --evict"]
    tests = [
        "test_gradients_of_ranks_sharing_a_gpu_equal_the_reference",
        "test_on_nccl_with_a_gpu_per_rank_the_gradients_equal_the_reference",
    ]
    assert collected == [f"tests/test_runtime_cuda.py::{t}[{s}]" for t in tests for s in schedules]
