"""Compile time of this checkout against another, per family: A B A B medians and their ratio.

    python bench/compile_ab.py --base /path/to/other/checkout [--pp 16] [--microbatches 64]
        [--families 1f1b,zb-v,v-adaptive:12] [--costs unit,1.5B] [--rounds 3]

A sample is one child process run in a checkout's own directory (its `passes`, `pipec`, ...):
it compiles the family once to warm its caches and imports, then three times, and reports the
median wall and CPU seconds of those three (compile_schedule: build, lower, simulate, verify).
The two checkouts alternate, base then this one, `--rounds` times; the table gives the median
sample of each and the ratio this/base. On a shared machine the CPU time is the steadier
figure. A family spec `name:limit` passes --memory-limit (rank shares). Costs are per op of
one chunk: unit (F=B=W=1, comm 0) and 1.5B (the zero-bubble paper's F=18.522, B=18.086,
W=9.337, comm=0.601).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
FAMILIES = (
    "1f1b,interleaved,zb-h1,zb-h2,zb-auto,zb-auto:32,zb-v,v-min,v-half,v-zb,v-adaptive,"
    "v-adaptive:12,dualpipev"
)
COSTS = {"unit": "F=1,B=1,W=1,comm=0", "1.5B": "F=18.522,B=18.086,W=9.337,comm=0.601"}
CHILD = """
import gc, json, sys, time
from pipec.passes.costs import parse_costs
from pipec.compile import compile_schedule
family, p, m, costs, limit = sys.argv[1:]
args = (family, int(p), int(m), None, parse_costs(costs), None if limit == "-" else float(limit))
compile_schedule(*args)
runs = []
for _ in range(3):
    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    compile_schedule(*args)
    runs.append((time.perf_counter() - w, time.process_time() - c))
print(json.dumps(sorted(runs)[1]))
"""


def sample(tree: Path, family: str, p: int, m: int, costs: str, limit: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one child's median compile in checkout `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    args = [sys.executable, "-c", CHILD, family, str(p), str(m), COSTS[costs], limit]
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{tree}: {family} failed: {done.stderr.strip().splitlines()[-1]}")
    wall, cpu = json.loads(done.stdout)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout's root")
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=64)
    ap.add_argument("--families", default=FAMILIES)
    ap.add_argument("--costs", default=",".join(COSTS))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"p={args.pp}, m={args.microbatches}; base {args.base}, this {HERE}")
    print(
        "| family | limit | costs | base wall s | this wall s | base cpu s | this cpu s "
        "| cpu ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.families.split(","):
        family, _, limit = spec.partition(":")
        for costs in args.costs.split(","):
            runs: dict[Path, list[tuple[float, float]]] = {args.base: [], HERE: []}
            for _ in range(args.rounds):
                for tree, found in runs.items():
                    found.append(
                        sample(tree, family, args.pp, args.microbatches, costs, limit or "-")
                    )
            (bw, bc), (tw, tc) = (
                (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
                for s in runs.values()
            )
            print(
                f"| {family} | {limit or '-'} | {costs} | {bw:.3f} | {tw:.3f} | {bc:.3f} "
                f"| {tc:.3f} | {tc / bc:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
