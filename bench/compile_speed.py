"""Compile time as p and m grow: schedule -> lowered, simulated, verified programs on disk.

    python bench/compile_speed.py [--schedule 1f1b] [--repeat 3] [--check]

Prints the median wall time of `compile_schedule` + `emit` (every output file written) per
(p, m), their median CPU time (less inflated by other jobs; with the forked children's, so
above the wall time where both cores worked), and the time per compute op,
whose flatness shows growth linear in p·m. With
`--check`, exits 1 unless the largest shape (p=64, m=1024) takes at most `--target` seconds
in all (issue 2's target: 2 s for 1f1b on a quiet 2-core machine).

The machine's own speed moves by up to 3x on this shared host within the hour, so
the bench also times a fixed pure-Python loop before and after the table: a rough gauge of
how fast the host was during the run (it uses one core; a compile uses two).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pipec.build_dir import emit
from pipec.compile import compile_schedule, gc_paused

SHAPES = [(4, 64), (8, 128), (16, 256), (32, 512), (64, 256), (64, 512), (64, 1024)]


def cpu_time() -> float:
    """CPU seconds of this process and of its finished children (a large compile verifies,
    and emit prints, half of its work in a forked child: pipec/beside.py)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(schedule: str, p: int, m: int, repeat: int) -> tuple[float, float, float]:
    """Median seconds of compile (verify included) and of emit, and median CPU seconds of
    both (what other jobs on the machine inflate less), over `repeat` runs."""
    compile_s, emit_s, cpu_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            gc.collect()  # a `pipec compile` process never pays for an earlier run's garbage
            with gc_paused():  # as in `pipec compile`: the collector scans after emit
                c0, t0 = cpu_time(), time.perf_counter()
                result = compile_schedule(schedule, p, m)
                t1 = time.perf_counter()
                emit(result, Path(tmp) / "out", force=True)
                compile_s.append(t1 - t0)
                emit_s.append(time.perf_counter() - t1)
                cpu_s.append(cpu_time() - c0)
            del result  # freeing 10^6 objects is not the next run's compile time
    return statistics.median(compile_s), statistics.median(emit_s), statistics.median(cpu_s)


def reference_loop() -> float:
    """Seconds for 10^7 additions in a Python loop: the speed of this machine right now, in
    the kind of work a compile does (bytecode, no I/O, no allocation to speak of)."""
    t0 = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="exit 1 if p=64, m=1024 misses --target")
    ap.add_argument("--target", type=float, default=2.0, help="seconds, compile + emit")
    args = ap.parse_args()
    print(f"schedule {args.schedule}, median of {args.repeat} runs")
    print(f"reference loop before: {reference_loop():.3f} s")
    head = ("p", 4), ("m", 6), ("ops", 8), ("compile s", 10), ("emit s", 8), ("total s", 8)
    print(" ".join(f"{name:>{w}}" for name, w in (*head, ("µs/op", 7), ("cpu s", 6))))
    for p, m in SHAPES:
        c, e, cpu = measure(args.schedule, p, m, args.repeat)
        ops = 2 * p * m  # compute ops of a fused-backward schedule
        per_op = 1e6 * (c + e) / ops
        row = f"{p:>4} {m:>6} {ops:>8} {c:>10.3f} {e:>8.3f} {c + e:>8.3f}"
        print(f"{row} {per_op:>7.1f} {cpu:>6.3f}")
    print(f"reference loop after: {reference_loop():.3f} s")
    if args.check:
        verdict = "met" if c + e <= args.target else "MISSED"
        print(f"target {args.target:g} s at p={p}, m={m}: {verdict} ({c + e:.3f} s)")
        sys.exit(0 if c + e <= args.target else 1)


if __name__ == "__main__":
    main()
