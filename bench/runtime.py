"""The runtime against the simulator: measured iteration time vs simulated, interpreter overhead.

For 2 and 4 ranks, compile the tiny GPT with costs profiled on this machine (one thread, as
each rank runs), train it under torchrun (gloo, CPU), and compare the measured makespan (first
compute start to last compute end, median over steps) with the simulated one; also the whole
iteration (with the optimizer step), the bubble, and the interpreter's own time per
instruction (loop wall time minus the handlers' time). Runs alternate between the
configurations (A B A B) and medians are reported, as FACTS.md asks on this noisy machine.

    PYTHONPATH=. python bench/runtime.py [--schedule 1f1b] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipec.build_dir import emit
from pipec.model import compile_model
from runtime.torchrun import torchrun

MODEL = f"{ROOT}/examples/gpt.py:tiny"


def run(build: Path, world: int, steps: int) -> dict:
    args = ("--steps", str(steps), "--threads", "1")
    cmd, env = torchrun(build / "launch.py", world, *args)
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads((build / "measured/stats.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # profile as each rank will run: one thread
    tmp = Path(tempfile.mkdtemp(prefix="pipec-bench-"))
    builds = {}
    for p in (2, 4):
        builds[p] = tmp / f"p{p}"
        emit(compile_model(MODEL, args.schedule, p, args.microbatches, profile=True), builds[p])
    runs: dict[int, list[dict]] = {p: [] for p in builds}
    for _ in range(args.repeats):
        for p, build in builds.items():  # A B A B: both see the same machine load
            runs[p].append(run(build, p, args.steps))
    print(
        f"tiny GPT, {args.schedule}, m={args.microbatches}, {args.steps} steps x {args.repeats} "
        f"runs per row (median), {os.cpu_count()} cores, gloo"
    )
    print(
        "| ranks | simulated makespan ms | measured makespan ms | ratio | measured iteration ms |"
        " bubble sim / measured | peak stash bytes measured / simulated (rank 0) | overhead us/instr |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p, stats in runs.items():
        sim = stats[0]["simulated"]
        med = {k: statistics.median(s["measured"][k] for s in stats) for k in stats[0]["measured"]}
        spread = [s["measured"]["makespan_ms"] for s in stats]
        overhead = statistics.median(
            r["overhead_us_per_instruction"] for s in stats for r in s["ranks"]
        )
        rank0 = stats[0]["ranks"][0]
        print(
            f"| {p} | {sim['makespan_ms']:.1f} | {med['makespan_ms']:.1f} "
            f"({min(spread):.1f}-{max(spread):.1f}) | {med['makespan_ms'] / sim['makespan_ms']:.2f} | "
            f"{med['iteration_ms']:.1f} | {sim['bubble']:.3f} / {med['bubble']:.3f} | "
            f"{rank0['peak_stash_bytes']} / {rank0['simulated_peak_stash_bytes']} | {overhead:.1f} |"
        )


if __name__ == "__main__":
    main()
