"""fp32 against bf16 training: iteration time and real peak bytes per rank, on the CPU (and on
the GPU when there is one).

    PYTHONPATH=. python bench/precision.py [--model examples/gpt.py:tiny] [--p 2] [--m 8]
        [--steps 6] [--repeats 3]

Compiles the model for 1F1B at p ranks, m micro-batches, then trains it `--steps` steps per run
through OUT/launch.py (`--precision fp32` and `--precision bf16`, gloo, one thread per rank on
the CPU; on CUDA NCCL with a GPU per rank, or `--share-gpu` when there are fewer GPUs than
ranks). Runs alternate A B A B … (`--repeats` of each), so both see the same machine load.
From each run's measured/metrics.jsonl (steps after the first): the median step time, and per
rank the highest real peak (runtime/meter.py). Prints per device: the medians over runs, and
bf16's ratio to fp32 for the time and for each rank's peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from pipec.build_dir import emit
from pipec.model import compile_model
from pipec.runtime.options import launch_parser
from pipec.runtime.torchrun import torchrun

PRECISIONS = ("fp32", "bf16")


def one_run(build: Path, world: int, steps: int, precision: str, extra: list[str]) -> dict:
    """Train once; the median step time (s) and each rank's highest real peak (bytes)."""
    args = ["--steps", str(steps), "--precision", precision, *extra]
    cmd, env = torchrun(build / "launch.py", world, *args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"bench/precision.py: the {precision} run failed:\n{proc.stderr[-2000:]}")
    lines = (build / "measured/metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines][1:]  # the first step pays one-time costs
    peaks = [max(ranks) for ranks in zip(*(r["real_peak_bytes_per_rank"] for r in records))]
    return {"step_s": statistics.median(r["step_s"] for r in records), "peaks": peaks}


def bench(build: Path, world: int, steps: int, repeats: int, device: str, extra: list[str]):
    runs: dict[str, list[dict]] = {p: [] for p in PRECISIONS}
    for k in range(repeats):
        for precision in PRECISIONS:  # A B A B: each sees the same machine load
            print(f"{device}: run {k + 1}/{repeats}, {precision}", file=sys.stderr, flush=True)
            runs[precision].append(one_run(build, world, steps, precision, extra))
    medians = {
        p: (
            statistics.median(r["step_s"] for r in rs),
            [statistics.median(col) for col in zip(*(r["peaks"] for r in rs))],
        )
        for p, rs in runs.items()
    }
    base_t, base_peaks = medians["fp32"]
    for precision, (t, peaks) in medians.items():
        mib = ", ".join(f"{b / 2**20:.2f}" for b in peaks)
        ratios = ", ".join(f"{b / a:.3f}" for a, b in zip(base_peaks, peaks))
        print(f"| {device} | {precision} | {t * 1000:.1f} | {t / base_t:.3f} | {mib} | {ratios} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=f"{ROOT}/examples/gpt.py:tiny")
    ap.add_argument("--p", type=int, default=2)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    options = {s for a in launch_parser()._actions for s in a.option_strings}
    if "--precision" not in options:
        print(
            "bench/precision.py: this pipec's launch.py has no --precision option yet; "
            "the benchmark compares --precision fp32 with bf16",
            file=sys.stderr,
        )
        sys.exit(2)
    # --backend gloo keeps the ranks on the CPU on a machine with a GPU too.
    devices = {"cpu": ["--backend", "gloo", "--threads", "1"]}
    if torch.cuda.is_available():
        shared = torch.cuda.device_count() < args.p
        devices["cuda"] = ["--share-gpu"] if shared else ["--backend", "nccl"]
    print(
        f"{args.model}, 1f1b p={args.p} m={args.m}, {args.steps} steps per run (steps 2.. "
        f"counted), {args.repeats} runs of each precision, alternating\n"
    )
    print("| device | precision | step ms (median) | vs fp32 | real peak MiB per rank | vs fp32 |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for device, extra in devices.items():
            build = Path(tmp) / device
            emit(compile_model(args.model, "1f1b", args.p, args.m), build)
            bench(build, args.p, args.steps, args.repeats, device, extra)


if __name__ == "__main__":
    main()
