"""Compile time of `--evict` (BPipe) as p and m grow, against the plain compile.

    python bench/evict_speed.py [--schedule 1f1b] [--repeat 3]

Prints the median wall time of `compile_schedule` without and with `evict=True` (at the
smallest feasible limit: the search plus the final plan, lowering, simulation and
verification included) per (p, m), runs interleaved so that load on a shared machine hits
both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipec.compile import compile_schedule

SHAPES = [(8, 32), (16, 64), (32, 128), (64, 256)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"schedule {args.schedule}, median of {args.repeat} interleaved runs")
    print(f"{'p':>4} {'m':>5} {'plain s':>8} {'evict s':>8} {'extra s':>8} {'limit':>6}")
    for p, m in SHAPES:
        plain, evict = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            compile_schedule(args.schedule, p, m)
            t1 = time.perf_counter()
            result = compile_schedule(args.schedule, p, m, evict=True)
            evict.append(time.perf_counter() - t1)
            plain.append(t1 - t0)
        a, b = statistics.median(plain), statistics.median(evict)
        print(f"{p:>4} {m:>5} {a:>8.2f} {b:>8.2f} {b - a:>8.2f} {result.plan['memory_limit']:>6g}")


if __name__ == "__main__":
    main()
