"""Planning time under each capture: torch.export (the default) against torch.fx.

    PYTHONPATH=$PWD python bench/capture.py [--repeat 3]

For `examples/gpt.py:tiny` (4 stages) and `examples/gpt.py:gpt3_96b` (8 stages, meta device),
times `build_model_plan` (capture, partition, FLOPs, stash bytes: what `pipec compile MODEL`
and `pipec simulate MODEL` spend on the model) in a fresh process per run, as the CLI does:
export's first use in a process pays for its imports. The runs of the two captures
alternate (fx, export, fx, export, …) so that the load of a shared machine falls on both.
Prints the median wall and CPU seconds per capture and export's ratio to fx; CPU time is
what other jobs inflate less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"examples/gpt.py:tiny": 4, "examples/gpt.py:gpt3_96b": 8}
CAPTURES = ("fx", "export")

# One run in a fresh interpreter: prints {"wall": s, "cpu": s, "capture": used}.
RUN = """
import json, sys, time
from dataclasses import replace
from pipec.frontend import build_model_plan, load_factory
spec = replace(load_factory(sys.argv[1]), capture=sys.argv[2])
wall, cpu = time.perf_counter(), time.process_time()
plan = build_model_plan(spec, int(sys.argv[3]), progress=False)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"wall": wall, "cpu": cpu, "capture": plan.capture}))
"""


def run_once(model: str, capture: str, stages: int) -> dict:
    """One run's wall and CPU seconds, in a fresh interpreter on one thread."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", RUN, str(ROOT / model), capture, str(stages)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["capture"] == capture, result  # the capture asked for, not a fallback
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per model and capture")
    args = ap.parse_args()
    print(f"{'model':<28}{'capture':<9}{'wall s':>8}{'cpu s':>8}{'cpu ratio':>11}")
    for model, stages in MODELS.items():
        runs: dict[str, list[dict]] = {c: [] for c in CAPTURES}
        for _ in range(args.repeat):
            for capture in CAPTURES:
                runs[capture].append(run_once(model, capture, stages))
        medians = {
            c: {k: statistics.median(r[k] for r in runs[c]) for k in ("wall", "cpu")}
            for c in CAPTURES
        }
        for capture in CAPTURES:
            m = medians[capture]
            ratio = m["cpu"] / medians["fx"]["cpu"]
            print(f"{model:<28}{capture:<9}{m['wall']:>8.2f}{m['cpu']:>8.2f}{ratio:>10.2f}x")


if __name__ == "__main__":
    main()
