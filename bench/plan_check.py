"""Check `pipec plan`'s predictions against real runs: its time, its memory, its pick.

    PYTHONPATH=. python bench/plan_check.py [--model FILE:FACTORY] [--pp 2] [-B 32]
        [--budget 64MiB] [--rounds 5] [--steps 10] [--keep DIR] [--dry-run]

For each P: plan the model with `pipec plan`'s own command line (its calibration run included,
one thread per rank, as torchrun gives each rank), take the plan's top three rows, its 1F1B
baseline and plain 1F1B at the pick's micro-batch size and count, build each with the
`pipec compile` command the plan gives for it, and train them all in ONE torchrun launch,
taking turns round after round (A B C D A B C D ..., pipec/plan/calibrate_worker.py) so that
load from other processes hits every build alike. Each turn's first step is a warm-up. It checks:

- each predicted iteration time is within 10% of the measured median (the median over rounds
  of each turn's median);
- each rank's predicted peak bytes are within 10% of the real peak the runtime's meter read;
- the measured order is the predicted one, or the rows it swaps are ties in the plan;
- the plan's pick measures no slower than 1.02x its 1F1B baseline and than 1F1B at the pick's
  micro-batch size and count (the median over rounds of each round's ratio).

The machine's load average is printed before and after each launch: on a machine other jobs
share, the figures measure the load as much as the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipec.build_dir import MEASURED
from pipec.plan.calibrate_run import WORKER
from pipec.runtime.torchrun import torchrun

GPT = "examples/gpt.py:tiny"
TIME_TOLERANCE = 0.10
MEMORY_TOLERANCE = 0.10
PICK_TOLERANCE = 1.02


def pipec(*args: str) -> str:
    """Run `pipec ARGS` from the checkout; its stdout (stderr passes through)."""
    done = subprocess.run(
        [sys.executable, "-m", "pipec", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"plan_check: pipec {shlex.join(args[:3])} ... exited {done.returncode}")
    return done.stdout


def load_line(before: float) -> str:
    after, cores = os.getloadavg()[0], os.cpu_count()
    return f"load average {before:.1f} before, {after:.1f} after, on {cores} cores"


def chosen_rows(plan: dict) -> list[tuple[str, dict]]:
    """(role, row): the top three, the baseline, plain 1F1B at the pick's mbs and m; each once."""
    rows = [(f"row {k}", row) for k, row in enumerate(plan["candidates"][:3], 1)]
    pick = plan["candidates"][0]
    every = plan["candidates"] + plan["over_budget"]
    same = next(
        (
            r
            for r in every
            if (r["schedule"], r["strategy"], r["mbs"], r["m"])
            == ("1f1b", "plain", pick["mbs"], pick["m"])
        ),
        None,
    )
    for role, row in (("baseline", plan["baseline"]), ("1f1b at the pick's mbs", same)):
        if row is not None:
            rows.append((role, row))
    listed = {r["command"]: (k, r["place"]) for k, r in enumerate(plan["candidates"], 1)}
    out: dict[str, tuple[str, dict]] = {}
    for role, row in rows:
        number, place = listed.get(row["command"], (None, "-"))
        row = row | {"row": number, "place": place}
        if row["command"] in out:
            out[row["command"]] = (out[row["command"]][0] + ", " + role, row)
        else:
            out[row["command"]] = (role, row)
    return list(out.values())


def build(row: dict, out: Path) -> None:
    """The row's own `pipec compile` command, into `out`."""
    argv = shlex.split(row["command"])[1:]
    argv[argv.index("--out") + 1] = str(out)
    pipec(*argv, "--force")


def train(p: int, builds: list[Path], rounds: int, steps: int) -> str:
    """Every build in turns, in one torchrun launch of `p` ranks of one thread each."""
    before = os.getloadavg()[0]
    args = ["--threads", "1", "--rounds", str(rounds), "--steps", str(steps)]
    cmd, env = torchrun(WORKER, p, *args, *map(str, builds))
    env = env | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"plan_check: the torchrun launch failed:\n{done.stderr[-3000:]}")
    return load_line(before)


def turns(out: Path, rounds: int) -> tuple[list[float], list[int]]:
    """Each round's median iteration time (s) of the build in `out`, and each rank's real
    peak bytes (the highest over the rounds)."""
    medians, peaks = [], []
    for k in range(rounds):
        stats = json.loads((out / MEASURED / f"stats_round{k}.json").read_text())
        medians.append(statistics.median(s["iteration_ms"] / 1e3 for s in stats["per_step"]))
        peaks.append([int(r["real_peak_bytes"]) for r in stats["ranks"]])
    return medians, [max(col) for col in zip(*peaks)]


def check_p(p: int, args: argparse.Namespace, where: Path) -> bool:
    before = os.getloadavg()[0]
    plan = json.loads(
        pipec(
            "plan", args.model, "--pp", str(p), "-B", str(args.global_batch),
            "--memory-per-device", args.budget, "--threads", "1", "--json",
            "--save-profile", str(where / f"p{p}-profile.json"),
        )
    )  # fmt: skip
    print(f"\np={p}: planned ({load_line(before)})")
    print(
        f"  expected error {plan['expected_error']:.1%}"
        if plan["expected_error"]
        else "  uncalibrated"
    )
    chosen = chosen_rows(plan)
    builds = []
    for k, (role, row) in enumerate(chosen):
        out = where / f"p{p}_{k}"
        print(f"  {role:<28} {name(row):<30} predicted {row['iteration_s'] * 1e3:.2f} ms")
        if not args.dry_run:
            build(row, out)
        builds.append(out)
    if args.dry_run:
        return True
    print(f"  (trained: {train(p, builds, args.rounds, args.steps)})")
    measured = [turns(out, args.rounds) for out in builds]
    return report(chosen, measured)


def name(row: dict) -> str:
    return f"{row['schedule']} {row['strategy']} mbs {row['mbs']} m {row['m']}"


def report(chosen: list[tuple[str, dict]], measured: list[tuple[list[float], list[int]]]) -> bool:
    ok = True
    print(
        f"  {'row':<30} {'place':>5} {'predicted':>10} {'measured':>10} {'spread':>7} "
        f"{'error':>7}  peak bytes error per rank"
    )
    medians = []
    for (role, row), (times, peaks) in zip(chosen, measured):
        med = statistics.median(times)
        medians.append(med)
        error = row["iteration_s"] / med - 1
        mem = [r["total"] / real - 1 for r, real in zip(row["memory"], peaks)]
        ok &= abs(error) <= TIME_TOLERANCE and all(abs(e) <= MEMORY_TOLERANCE for e in mem)
        print(
            f"  {name(row):<30} {row['place']!s:>5} {row['iteration_s'] * 1e3:>8.2f}ms "
            f"{med * 1e3:>8.2f}ms {(max(times) - min(times)) / med:>7.0%} {error:>+7.1%}  "
            + " ".join(f"{e:+.1%}" for e in mem)
        )
    # The plan's order: its rows as listed (ties in any order); rows it did not rank, out.
    listed = [k for k, (_, row) in enumerate(chosen) if row["row"] is not None]
    ranked = sorted(listed, key=lambda k: chosen[k][1]["row"])
    number = {k: chosen[k][1]["row"] for k in ranked}
    swapped = [
        (number[i], number[j])
        for n, i in enumerate(ranked)
        for j in ranked[n + 1 :]
        if medians[i] > medians[j] and chosen[i][1]["place"] != chosen[j][1]["place"]
    ]
    order = [number[k] for k in sorted(ranked, key=lambda k: medians[k])]
    print(
        f"  order: plan rows predicted {[number[k] for k in ranked]}, measured {order}"
        + (
            f" -> swaps rows the plan ranks apart: {swapped}"
            if swapped
            else " -> ok (ties may swap)"
        )
    )
    ok &= not swapped
    pick_times = measured[0][0]
    for k, (role, _) in enumerate(chosen):
        if "baseline" in role or "pick's mbs" in role:
            ratio = statistics.median(a / b for a, b in zip(pick_times, measured[k][0]))
            ok &= ratio <= PICK_TOLERANCE
            print(f"  pick / {role}: x{ratio:.3f} (median over rounds; at most x{PICK_TOLERANCE})")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=GPT, help="FILE:FACTORY to plan (default: the tiny GPT)")
    ap.add_argument("--pp", default="2", help="pipeline sizes to check, e.g. 2,4")
    ap.add_argument("--global-batch", "-B", type=int, default=32)
    ap.add_argument("--budget", default="64MiB", help="--memory-per-device")
    ap.add_argument("--rounds", type=int, default=5, help="turns of each build")
    ap.add_argument("--steps", type=int, default=10, help="steps per turn (the first a warm-up)")
    ap.add_argument("--keep", type=Path, default=None, help="build under this folder and keep it")
    ap.add_argument("--dry-run", action="store_true", help="plan and list; train nothing")
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="plan_check_") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for p in (int(x) for x in args.pp.split(",")):
            ok &= check_p(p, args, where.resolve())
    if args.dry_run:
        print("\nplan_check: dry run, nothing trained")
        return
    print("\nplan_check:", "all checks pass" if ok else "FAILED (see above)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
