"""Instructions a compile executes, counted by callgrind: a compile-speed figure the host's noise
cannot move.

    python bench/compile_instructions.py [--schedule 1f1b] [--shape 32x256 ...]

Wall time on this shared machine swings by up to 3x within the hour (bench/compile_speed.py), so
two versions of the code compare best by the CPU instructions one `compile_schedule` + `emit`
executes. Each shape runs in two processes under `valgrind --tool=callgrind`, one compiling once
and one twice; the difference is one compile, without start-up and imports. The default shapes
stay under `pipec.beside.MIN_FORKED_WORK` instructions, so every pass runs in the one process
and is counted (callgrind does not follow forked children). Needs valgrind; callgrind runs
Python about 50x slower, hence the small shapes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: One compile + emit per repeat, the collector paused as in `pipec compile`.
CHILD = """
import gc, sys
from pathlib import Path
from pipec.build_dir import emit
from pipec.compile import compile_schedule
gc.disable()
schedule, out = sys.argv[1], sys.argv[5]
p, m, repeat = (int(x) for x in sys.argv[2:5])
kept = []  # held: freeing a result is not compile time (`pipec compile` never frees it)
for _ in range(repeat):
    result = compile_schedule(schedule, p, m)
    emit(result, Path(out), force=True)
    kept.append(result)
"""


def instructions(schedule: str, p: int, m: int, repeat: int) -> int:
    """Instructions the whole child process executed (callgrind's 'Collected')."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
            sys.executable, "-c", CHILD, schedule, str(p), str(m), str(repeat), f"{tmp}/out",
        ]  # fmt: skip
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise SystemExit(f"compile_instructions: the callgrind run failed:\n{run.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--shape", nargs="+", default=["16x128", "32x256"], help="PxM, e.g. 32x256")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("compile_instructions: needs valgrind (apt install valgrind)")
    print(f"schedule {args.schedule}: instructions of one compile + emit")
    print(f"{'p':>4} {'m':>6} {'ops':>8} {'instructions':>14} {'per op':>8}")
    for shape in args.shape:
        p, m = (int(x) for x in shape.lower().split("x"))
        one = instructions(args.schedule, p, m, 1)
        two = instructions(args.schedule, p, m, 2)
        ops = 2 * p * m  # compute ops of a fused-backward schedule
        print(f"{p:>4} {m:>6} {ops:>8} {two - one:>14,} {(two - one) / ops:>8,.0f}")


if __name__ == "__main__":
    main()
