"""`make gpu-check`: everything that needs the GPU machine, then the figures docs/gpu.md records.

Each step is a command run from the checkout root with this Python; its output streams as it
runs, and the lines that carry its figures are collected into a summary at the end:

  kernel-tests   tests/test_attention.py on CUDA: the compiled kernel against SDPA, bf16 too
  kernel-speed   bench/attention.py: forward and backward vs SDPA flash, bf16, seq 1k/4k/8k
  runtime-cuda   every other test marked `gpu` (pytest -m gpu): the runtime with p ranks sharing
                 the GPU (gradients vs a single-process reference), the clock, --device
  pipeline-cuda  bench/gpu_pipeline.py: the tiny pipeline with p ranks sharing the GPU,
                 measured / simulated iteration time
  cuda-memory    bench/cuda_memory.py: real CUDA peak bytes per rank vs predicted
  runtime-4      bench/runtime.py on CPU (CUDA hidden): measured / simulated at 2 and 4 ranks
  plan-4         bench/plan_check.py --pp 4 on CPU: predicted vs measured order of plan's top 3

A step whose script does not exist in the checkout, or whose pytest selection is empty, is
skipped with a message saying so (a checkout that predates it). Without CUDA every step is
skipped and the exit code is 0; with CUDA it is 1 when a step failed.

    PYTHONPATH=$PWD python bench/gpu_check.py [--only kernel-speed,plan-4] [--list]

The device tool runs one command for at most 10 minutes, and a session has 15 minutes of device
time, machine start included: `--quick` trims the slow steps (seq 4k only for the kernel's
speed, two schedules of 8 steps for the pipeline, 1F1B and V-Half for memory, `--quick` runs of
bench/runtime.py), and two commands of it fit a session (timed on an H100, 2026-11-27):

    make gpu-check ARGS="--quick --only kernel-tests,runtime-cuda,kernel-speed"
    make gpu-check ARGS="--quick --only pipeline-cuda,cuda-memory,runtime-4,plan-4"

Every step is stopped after --step-limit seconds (default 540) and reported as timed out, so
that one hung step cannot spend the rest of the session.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_TESTS = 5  # pytest's exit code when the selection is empty
QUICK_TUNE = {"PIPEC_ATTENTION_AUTOTUNE": "0"}  # one config per shape: tests compile, not tune
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU: the figures the 2-core machines lack


@dataclass(frozen=True)
class Step:
    """One command; `figures` matches the lines of its output the summary quotes."""

    name: str
    what: str
    argv: tuple[str, ...]
    figures: str
    env: dict[str, str] = field(default_factory=dict)
    script: str | None = None  # the file the step needs; missing: skipped
    quick: tuple[str, ...] = ()  # arguments added by --quick

    def command(self, quick: bool) -> tuple[str, ...]:
        return self.argv + self.quick if quick else self.argv

    def missing(self) -> str | None:
        if self.script and not (ROOT / self.script).is_file():
            return f"{self.script} does not exist in this checkout yet"
        return None


def steps(out: Path) -> list[Step]:
    py = sys.executable
    pytest = (py, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    # the kernel's tests compile ~150 shapes one after another: 118 s with 8 workers on the
    # H100 machine's 16 cores; the GPU image has pytest-xdist, .venv does not
    workers = ("-n", "8") if importlib.util.find_spec("xdist") else ()
    passed = r"^\d+ (passed|failed)|^=+ .*(passed|failed)"
    return [
        Step(
            "kernel-tests",
            "the attention kernel's tests on CUDA",
            (*pytest, *workers, "tests/test_attention.py"),
            passed,
            QUICK_TUNE,
        ),
        Step(
            "kernel-speed",
            "attention speed vs SDPA flash (bf16)",
            (py, "bench/attention.py", "--json", str(out / "attention.json")),
            r"^goal|^last autotuned",
            script="bench/attention.py",
            quick=("--seqs", "4096"),  # the goal's row; 83 s on the H100 with autotuning
        ),
        Step(
            "runtime-cuda",
            "tests marked gpu outside the kernel's (runtime sharing the GPU, clock, --device)",
            (*pytest, "-m", "gpu", "tests", "--ignore=tests/test_attention.py"),
            passed,
            QUICK_TUNE,
        ),
        Step(
            "pipeline-cuda",
            "tiny pipeline, p ranks sharing the GPU: measured / simulated",
            (py, "bench/gpu_pipeline.py"),
            r" measured .* simulated ",
            script="bench/gpu_pipeline.py",
            quick=("--schedules", "1f1b,zb-v", "--steps", "8"),  # ~25 s a launch, two each
        ),
        Step(
            "cuda-memory",
            "real CUDA peak bytes per rank vs predicted",
            (py, "bench/cuda_memory.py"),
            r"rank \d+: real peak|^real/predicted",
            script="bench/cuda_memory.py",
            quick=("--schedules", "1f1b,v-half"),
        ),
        Step(
            "runtime-4",
            "bench/runtime.py on CPU, 2 and 4 ranks: measured / simulated (goal <= 1.10)",
            (py, "bench/runtime.py"),
            r"^\| (ranks|4) \|",
            CPU_ONLY,
            script="bench/runtime.py",
            quick=("--quick",),
        ),
        Step(
            "plan-4",
            "bench/plan_check.py at P=4 on CPU: predicted order = measured order",
            (py, "bench/plan_check.py", "--pp", "4"),
            r"order:|^plan_check: (all|FAILED)",
            CPU_ONLY,
            script="bench/plan_check.py",
        ),
    ]


def run(step: Step, quick: bool = False, limit_s: float = 540.0) -> tuple[str, list[str]]:
    """(outcome, figure lines) of one step, its output echoed as it comes; stopped after
    `limit_s` seconds."""
    env = {**os.environ, **step.env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    argv = step.command(quick)
    print(f"\n=== {step.name}: {step.what}\n$ {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    with subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the limit stops the step's torchrun and its ranks too
    ) as proc:
        stop = threading.Timer(limit_s, os.killpg, (proc.pid, 9))
        stop.start()
        lines = []
        for line in proc.stdout or ():
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
        proc.wait()
        stop.cancel()
    took = f"{time.perf_counter() - t0:.0f} s"
    figures = [line for line in lines if re.search(step.figures, line)]
    if time.perf_counter() - t0 >= limit_s and proc.returncode < 0:
        return f"FAILED (stopped at its limit, {limit_s:.0f} s)", figures
    if proc.returncode == NO_TESTS and step.argv[1:3] == ("-m", "pytest"):
        return f"skipped: no test selected yet ({took})", figures
    return (
        "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
    ) + f", {took}", figures


def kernel_figures(path: Path) -> list[str]:
    """The goal's rows of bench/attention.py's JSON: ratio ours / SDPA flash per mode."""
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())["rows"]
    return [
        f"seq {r['seq']} d {r['head_dim']} causal {r['causal']!s:<5} {r['mode']}: "
        f"{r['triton_tflops']:.0f} vs {r['sdpa_tflops']:.0f} TFLOP/s, ratio {r['ratio']:.2f}"
        for r in rows
        if r["seq"] == 4096 and r["head_dim"] == 128
    ]


def check(chosen: list[Step], out: Path, quick: bool = False, limit_s: float = 540.0) -> int:
    """Run the steps (all skipped without CUDA) and print the summary; the exit code."""
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU here; skipped every step:")
        for s in chosen:
            print(f"  {s.name:<14} {s.what}" + (f" ({s.missing()})" if s.missing() else ""))
        return 0
    name = torch.cuda.get_device_name()
    print(f"gpu_check: {name}, torch {torch.__version__}, {os.cpu_count()} cores")
    summary = []
    for s in chosen:
        if s.missing():
            summary.append((s, f"skipped: {s.missing()}", []))
            continue
        outcome, figures = run(s, quick, limit_s)
        if s.name == "kernel-speed":
            figures = kernel_figures(out / "attention.json") + figures
        summary.append((s, outcome, figures))
    print("\n=== summary: the figures docs/gpu.md records")
    for s, outcome, figures in summary:
        print(f"{s.name} ({s.what}): {outcome}")
        for line in figures:
            print(f"    {line}")
    return 1 if any(outcome.startswith("FAILED") for _, outcome, _ in summary) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated step names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the steps and exit")
    ap.add_argument("--quick", action="store_true", help="the trimmed steps (see above)")
    ap.add_argument("--step-limit", type=float, default=540.0, help="seconds a step may run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        every = steps(Path(tmp))
        names = [s.name for s in every]
        only = [n for n in args.only.split(",") if n]
        if unknown := [n for n in only if n not in names]:
            print(
                f"gpu_check: --only {','.join(unknown)}: no such step; steps: {', '.join(names)}",
                file=sys.stderr,
            )
            return 2
        chosen = [s for s in every if not only or s.name in only]
        if args.list:
            for s in chosen:
                print(f"{s.name:<14} {s.what}\n{'':<14} $ {' '.join(s.command(args.quick))}")
            return 0
        return check(chosen, Path(tmp), args.quick, args.step_limit)


if __name__ == "__main__":
    sys.exit(main())
