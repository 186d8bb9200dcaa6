"""The runtime against the simulator: measured iteration time vs simulated, and where the gap is.

For 2 and 4 ranks, compile the tiny GPT with costs profiled on this machine (`--threads`, one
by default, as each rank runs) plus `comm` = gloo's measured one-way latency of one activation
(`bench/p2p_latency.py`, the sender computing after its isend, as a pipeline rank does); train
it under torchrun (gloo, CPU, the same threads per rank) and compare the measured makespan
(first compute start to last compute end, median over steps) with the simulated one. Then
split the gap:
- replay: each step's programs played by the simulator with that step's own measured op
  durations and the same latency (runtime/measure.py; stats.json's `replay_ms`): measured /
  replay, the median over steps of each step's ratio, is what the runtime itself adds (waits
  beyond the latency, interpreter, sends), whatever the machine's load did to compute. Beside
  it, the coarser replay this bench used before: one step played with each op kind's median
  duration per stage (the last step's), against the median makespan: a step whose ops the
  host slowed counts there as the runtime's;
- cores bound: the run's total busy time / cores, the shortest makespan this many cores
  allow; above the simulated makespan when the ranks cannot all compute at once;
- the interpreter's own time per instruction (loop wall time minus the handlers' time).
Runs alternate between the configurations (A B A B); medians are reported.

    PYTHONPATH=. python bench/runtime.py [--schedule 1f1b] [--steps 20] [--repeats 3] [--quick]
                                         [--threads 1]

One thread by default on every machine, as the 2-core hosts always ran: profile and run then
time the same ops. The default was cores // ranks threads, profiled with one: on a 16-core
machine that read measured / simulated 2.22 and measured / replay 1.58 at 4 ranks of 4 threads,
every core taken before gloo's lanes and the loop had one (gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipec.build_dir import Build, emit, load
from pipec.ir import COMPUTE_OPS
from pipec.model import compile_model
from pipec.passes.costs import CostModel
from pipec.runtime.measure import replayed_ms
from pipec.runtime.torchrun import torchrun

MODEL = f"{ROOT}/examples/gpt.py:tiny"
CORES = os.cpu_count() or 1


def latency_ms(nbytes: int, out: Path) -> dict:
    cmd, env = torchrun(ROOT / "bench/p2p_latency.py", 2, str(nbytes), str(out))
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def run(build: Path, world: int, steps: int, threads: int) -> dict:
    args = ("--steps", str(steps), "--threads", str(threads))
    cmd, env = torchrun(build / "launch.py", world, *args)
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    stats = json.loads((build / "measured/stats.json").read_text())
    trace = json.loads((build / "measured/timeline.json").read_text())
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            durations[(e["cat"], e["args"]["stage"])].append(e["dur"] / 1000.0)
    return {"stats": stats, "replay_ms": replay(load(build), durations)}


def replay(
    build: Build, durations: Mapping[tuple[str, int], list[float]], comm: float | None = None
) -> float:
    """Makespan of the build's programs played with the op durations a run measured, in ms per
    (op, stage) (each op charged its kind's median on its stage: RECOMPUTE, a fused BW and a
    split B or W alike, `runtime/measure.replayed_ms`); `comm`: the latency, else the build's."""
    c = build.compiled
    median = {key: statistics.median(ds) for key, ds in durations.items()}
    ops = {
        r: [median[(i.op.value, i.stage)] for i in prog if i.op in COMPUTE_OPS]
        for r, prog in enumerate(c.programs)
    }
    costs = build.costs if comm is None else replace(build.costs, comm=comm)
    return replayed_ms(ops, c, costs)


def activation_bytes(build: Path) -> int:
    """Bytes of one activation message between stage 0 and 1."""
    facts = json.loads((build / "plan.json").read_text())["model"]["stages"][0]["outputs"]
    return sum(torch.empty(t["shape"], dtype=getattr(torch, t["dtype"])).nbytes for t in facts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="10 steps, 2 repeats")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    args = ap.parse_args()
    steps, repeats = (10, 2) if args.quick else (args.steps, args.repeats)
    torch.set_num_threads(args.threads)  # profile as each rank will run
    tmp = Path(tempfile.mkdtemp(prefix="pipec-bench-"))
    probe = tmp / "probe"
    emit(compile_model(MODEL, args.schedule, 2, args.microbatches), probe)
    lat = latency_ms(activation_bytes(probe), tmp / "latency.json")
    comm = CostModel(comm=lat["busy_ms"])
    builds = {}
    for p in (2, 4):
        builds[p] = tmp / f"p{p}"
        result = compile_model(MODEL, args.schedule, p, args.microbatches, costs=comm, profile=True)
        emit(result, builds[p])
    runs: dict[int, list[dict]] = {p: [] for p in builds}
    for _ in range(repeats):
        for p, build in builds.items():  # A B A B: both see the same machine load
            runs[p].append(run(build, p, steps, args.threads))
    print(
        f"\ntiny GPT, {args.schedule}, m={args.microbatches}, {steps} steps x {repeats} runs per "
        f"row (median), {CORES} cores, gloo; one activation ({lat['bytes']} B) arrives "
        f"{lat['idle_ms']:.2f} ms after isend with the sender idle, {lat['busy_ms']:.2f} ms with "
        f"it computing (the simulation's comm)"
    )
    print(
        "| ranks | threads | simulated ms | measured ms (spread) | ratio | replay ms | "
        "measured / replay | op medians' replay ms, ratio | cores bound ms | iteration ms | "
        "bubble sim / measured | overhead us/instr |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p, rs in runs.items():
        stats = [r["stats"] for r in rs]
        sim = stats[0]["simulated"]
        med = {k: statistics.median(s["measured"][k] for s in stats) for k in stats[0]["measured"]}
        spread = [s["measured"]["makespan_ms"] for s in stats]
        coarse = statistics.median(r["replay_ms"] for r in rs)
        own = statistics.median(x["makespan_over_replay"] for s in stats for x in s["per_step"])
        bound = statistics.median(sum(x["busy_ms"] for x in s["ranks"]) / CORES for s in stats)
        overhead = statistics.median(
            r["overhead_us_per_instruction"] for s in stats for r in s["ranks"]
        )
        print(
            f"| {p} | {args.threads} | {sim['makespan_ms']:.1f} | {med['makespan_ms']:.1f} "
            f"({min(spread):.1f}-{max(spread):.1f}) | "
            f"{med['makespan_ms'] / sim['makespan_ms']:.2f} "
            f"| {med['replay_ms']:.1f} | {own:.2f} | {coarse:.1f}, "
            f"{med['makespan_ms'] / coarse:.2f} | {bound:.1f} | "
            f"{med['iteration_ms']:.1f} | {sim['bubble']:.3f} / {med['bubble']:.3f} | "
            f"{overhead:.1f} |"
        )


if __name__ == "__main__":
    main()
