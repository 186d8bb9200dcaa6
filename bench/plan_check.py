"""Check `pipec plan`'s predictions against real runs of the tiny GPT under torchrun.

    PYTHONPATH=. python bench/plan_check.py [--pp 2,4] [--rounds 5] [--steps 6] [--dry-run]

For each P: plan the tiny GPT (profiled with one thread, as torchrun gives each rank), take
the top three candidates and the 1F1B baseline, build each for the real model with the plan's
own costs (`pipec.plan.build.compile_candidate`: the programs the plan simulated), and train
them in ONE torchrun launch, taking turns round after round (A B C D A B C D …,
bench/plan_check_worker.py) so that load from other processes hits every candidate alike.
The runtime measures each turn itself (OUT/measured/stats.json, runtime/measure.py). It
checks, as issue 9 asks:

- the measured iteration times (median over rounds of each turn's median) come in the
  predicted order;
- each predicted time is within 25% of the measured median (the spread over rounds printed);
- each rank's predicted peak bytes are within 10% of the real peak the runtime's meter measured.

Micro-batch size: the tiny GPT's factory takes it (`micro_batch_size`), and each build
records the candidate's, which the runtime asks the factory for.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipec.ir import PipecError
from pipec.plan.candidates import Evaluated, PlanRequest
from pipec.plan.driver import plan_model
from pipec.runtime.torchrun import torchrun

GPT = "examples/gpt.py:tiny"
TIME_TOLERANCE = 0.25
MEMORY_TOLERANCE = 0.10


def picks(plan) -> list[Evaluated]:  # type: ignore[no-untyped-def]
    """The top three candidates and the 1F1B baseline, fastest predicted first."""
    chosen = list(plan.evaluation.fits[:3])
    if plan.baseline is not None and plan.baseline not in chosen:
        chosen.append(plan.baseline)
    return chosen


def compile_candidate(ev: Evaluated, spec: str, out: Path) -> None:
    """Emit the programs the plan simulated for `ev`, with its costs (pipec.plan.build)."""
    from pipec.build_dir import emit
    from pipec.plan.build import compile_candidate as build

    emit(build(ev, spec), out, force=True)


WORKER = ROOT / "bench" / "plan_check_worker.py"
MESSAGE_BYTES = 4 * 32 * 64 * 4
"""A tiny-GPT stage boundary at micro-batch size 4: (4, 32, 64) fp32."""


def measure_comm(tmp: Path, nbytes: int) -> float:
    """Seconds one pipeline message of `nbytes` takes between two gloo ranks here."""
    out = tmp / "ping.json"
    run_worker(2, "ping", str(nbytes), str(out))
    return json.loads(out.read_text())["median_s"]


def run_worker(p: int, *args: str) -> None:
    """One torchrun launch of the worker; prints the machine's load average around it (the
    figures mean little when other processes hold the cores)."""
    before = os.getloadavg()[0]
    cmd, env = torchrun(WORKER, p, *args)
    env = env | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"plan_check: the torchrun launch failed:\n{proc.stderr[-3000:]}")
    print(
        f"  (load average {before:.1f} before, {os.getloadavg()[0]:.1f} after, "
        f"on {os.cpu_count()} cores)"
    )


def read_measured(out: Path, round_: int) -> tuple[float, list[int]]:
    """(iteration seconds, per-rank real peak bytes) of one turn of the build in `out`.

    The runtime's stats (runtime/measure.py): per kept step (the turn's first, a warm-up, left
    out) the iteration time in ms, the slowest rank's wall time from a common barrier; per
    rank the real peak bytes its meter read over the kept steps (runtime/meter.py).
    """
    stats = json.loads((out / "measured" / f"stats_round{round_}.json").read_text())
    per_step = [s["iteration_ms"] / 1e3 for s in stats["per_step"]]
    return statistics.median(per_step), [int(r["real_peak_bytes"]) for r in stats["ranks"]]


def check_p(p: int, args: argparse.Namespace, tmp: Path) -> bool:
    req = PlanRequest(p, args.global_batch, args.budget, comm_s=args.comm)
    plan = plan_model(GPT, req, time_budget=args.time_budget, progress=False)
    chosen = picks(plan)
    print(f"\np={p}: {len(plan.evaluation.fits)} candidates fit; checking {len(chosen)}")
    builds = []
    for k, ev in enumerate(chosen):
        out = tmp / f"p{p}_{k}"
        print(
            f"  {ev.schedule:<12} {ev.strategy:<10} mbs {ev.mbs:>3} m {ev.m:>3}: "
            f"predicted {ev.iteration_s * 1e3:.2f} ms"
        )
        if not args.dry_run:
            compile_candidate(ev, GPT, out)
        builds.append(out)
    if args.dry_run:
        return False
    run_worker(p, str(args.rounds), str(args.steps), *map(str, builds))
    times: list[list[float]] = [[] for _ in chosen]
    real: list[list[int]] = [[] for _ in chosen]
    for k, out in enumerate(builds):
        for r in range(args.rounds):
            t, real[k] = read_measured(out, r)
            times[k].append(t)
    return report(chosen, times, real)


def report(chosen: list[Evaluated], times: list[list[float]], real: list[list[int]]) -> bool:
    ok = True
    medians = [statistics.median(t) for t in times]
    print(
        f"  {'candidate':<28} {'predicted':>10} {'measured':>10} {'spread':>7} {'error':>7}  "
        "peak bytes error per rank"
    )
    for ev, t, med, measured in zip(chosen, times, medians, real):
        error = ev.iteration_s / med - 1
        spread = (max(t) - min(t)) / med
        mem = [r.total / m - 1 for r, m in zip(ev.memory, measured)]
        ok &= abs(error) <= TIME_TOLERANCE and all(abs(e) <= MEMORY_TOLERANCE for e in mem)
        name = f"{ev.schedule} {ev.strategy} mbs {ev.mbs}"
        print(
            f"  {name:<28} {ev.iteration_s * 1e3:>8.2f}ms {med * 1e3:>8.2f}ms "
            f"{spread:>7.0%} {error:>+7.0%}  {' '.join(f'{e:+.0%}' for e in mem)}"
        )
    predicted = sorted(range(len(chosen)), key=lambda k: chosen[k].iteration_s)
    measured = sorted(range(len(chosen)), key=lambda k: medians[k])
    print(
        f"  order: predicted {predicted}, measured {measured}"
        f" -> {'match' if predicted == measured else 'MISMATCH'}"
    )
    return ok and predicted == measured


def main() -> None:
    from pipec.plan.memory import parse_bytes

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="2,4", help="pipeline sizes to check")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--budget", type=parse_bytes, default=parse_bytes("8MiB"))
    ap.add_argument("--rounds", type=int, default=5, help="turns of each candidate")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--time-budget", type=float, default=30.0)
    ap.add_argument(
        "--comm", type=float, default=None, help="seconds per message (default: measured)"
    )
    ap.add_argument("--keep", type=Path, default=None, help="build under this folder and keep it")
    ap.add_argument("--dry-run", action="store_true", help="plan and list; run nothing")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # torchrun gives each rank one thread (OMP_NUM_THREADS=1)
    ok = True
    with tempfile.TemporaryDirectory(prefix="plan_check_") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        if args.comm is None:
            args.comm = 0.0 if args.dry_run else measure_comm(where, MESSAGE_BYTES)
        print(f"plan_check: comm {args.comm * 1e6:.0f} us per message (gloo, {MESSAGE_BYTES} B)")
        for p in (int(x) for x in args.pp.split(",")):
            try:
                ok &= check_p(p, args, where)
            except PipecError as e:
                print(f"plan_check: {e}", file=sys.stderr)
                sys.exit(2)
    if args.dry_run:
        print("\nplan_check: dry run, nothing measured")
        return
    print("\nplan_check:", "all checks pass" if ok else "FAILED (see above)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
