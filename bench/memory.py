"""Real peak bytes per rank, predicted vs measured, for each schedule on the tiny and deep GPT;
and what the gloo runtime's receive-posting policy costs in time and memory.

    PYTHONPATH=. python bench/memory.py [--models tiny,deep] [--steps 4] [--posting]

Peaks: compile examples/gpt.py:tiny at p=4, m=8 and examples/gpt.py:deep at p=8, m=16 for
1F1B, 1F1B --evict, V-Min, V-Half and ZB-H1; train each `--steps` steps under torchrun (gloo,
CPU, one thread per rank) through OUT/launch.py; print per rank the predicted peak
(passes/memory_bytes.py with this machine's per-stash extras, runtime/measure.py's
`predicted_peaks`) beside the real peak the meter measured (runtime/meter.py, the steps after
the first), and their ratio. Then rank 0's saving from --evict, predicted and real.

Posting (--posting): tiny GPT, 1F1B, p=2 and p=4, m=8: receives posted at the step's start,
one compute instruction ahead of their consumer (the gloo default) and at their program
positions; runs alternate A B C A B C; median makespan and its ratio to posting at the start,
and the rank peaks of the last run.
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

from pipec.build_dir import emit
from pipec.model import compile_model
from pipec.runtime.measure import predicted_peaks
from pipec.runtime.torchrun import torchrun

MODELS = {"tiny": (4, 8), "deep": (8, 16)}
SCHEDULES = ("1f1b", "1f1b --evict", "v-min", "v-half", "zb-h1")
POLICIES = {"start": None, "ahead 1": 1, "in place": 0}


def train(build: Path, world: int, steps: int, ahead: str = "default") -> dict:
    """One run of the build under torchrun (this file as the worker); its measured stats."""
    args = ("--worker", str(build), ahead, "--steps", str(steps), "--threads", "1")
    cmd, env = torchrun(Path(__file__).resolve(), world, *args)
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads((build / "measured/stats.json").read_text())


def worker(argv: list[str]) -> None:
    """A rank: the runtime's entry point, with the receive policy set first (if given)."""
    from pipec.passes import memory_bytes
    from pipec.runtime.faults import take_termination_signals
    from pipec.runtime.main import main

    build, ahead, *rest = argv
    if ahead != "default":
        memory_bytes.POST_AHEAD["gloo"] = POLICIES[ahead]
    take_termination_signals()
    main(Path(build), rest)


def peaks(models: list[str], steps: int, tmp: Path) -> None:
    for name in models:
        p, m = MODELS[name]
        spec = f"{ROOT}/examples/gpt.py:{name}"
        print(f"\nexamples/gpt.py:{name}, p={p}, m={m}, {steps} steps (peaks of steps 2..), gloo")
        print("| schedule | " + " | ".join(f"rank {r}" for r in range(p)) + " |")
        print("|---|" + "---|" * p)
        rank0 = {}
        for schedule in SCHEDULES:
            family, evict = schedule.split()[0], schedule.endswith("--evict")
            result = compile_model(spec, family, p, m, evict=evict)
            build = tmp / f"{name}-{family}{'-evict' if evict else ''}"
            emit(result, build)
            stats = train(build, p, steps)
            predicted = predicted_peaks(
                result.plan, result.compiled, result.costs, result.sim, "cpu"
            )
            real = [r["real_peak_bytes"] for r in stats["ranks"]]
            cells = (
                f"{x.total / 2**20:.2f} / {y / 2**20:.2f} MiB ({y / x.total:.3f})"
                for x, y in zip(predicted, real)
            )
            print(f"| {schedule} | " + " | ".join(cells) + " |")
            rank0[schedule] = (predicted[0].total, real[0])
        (a, ra), (b0, rb) = rank0["1f1b"], rank0["1f1b --evict"]
        print(
            f"\nrank 0 with --evict: {(a - b0) / 2**10:.0f} KiB predicted saving, "
            f"{(ra - rb) / 2**10:.0f} KiB real ({(ra - rb) / (a - b0):.2f} of it)"
        )


def posting(steps: int, repeats: int, tmp: Path) -> None:
    spec = f"{ROOT}/examples/gpt.py:tiny"
    print(f"\ntiny GPT, 1f1b, m=8, {steps} steps x {repeats} runs per cell (median), gloo")
    print("| ranks | policy | makespan ms | vs start | rank peaks MiB (last run) |")
    print("|---|---|---|---|---|")
    for p in (2, 4):
        build = tmp / f"posting-p{p}"
        emit(compile_model(spec, "1f1b", p, 8), build)
        runs: dict[str, list[dict]] = {k: [] for k in POLICIES}
        for _ in range(repeats):
            for policy in POLICIES:  # A B C A B C: each sees the same machine load
                runs[policy].append(train(build, p, steps, policy))
        base = statistics.median(s["measured"]["makespan_ms"] for s in runs["start"])
        for policy, stats in runs.items():
            ms = statistics.median(s["measured"]["makespan_ms"] for s in stats)
            peaks_mib = ", ".join(f"{r['real_peak_bytes'] / 2**20:.2f}" for r in stats[-1]["ranks"])
            print(f"| {p} | {policy} | {ms:.1f} | {ms / base:.3f} | {peaks_mib} |")


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,deep")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--posting", action="store_true", help="compare the receive policies")
    ap.add_argument("--repeats", type=int, default=3, help="runs per policy (--posting)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pipec-memory-"))
    if args.posting:
        posting(max(args.steps, 10), args.repeats, tmp)
    else:
        peaks(args.models.split(","), args.steps, tmp)


if __name__ == "__main__":
    main()
