"""Real CUDA peak bytes per rank against the prediction, p ranks sharing one GPU.

    PYTHONPATH=$PWD python bench/cuda_memory.py [--schedules 1f1b,v-half] [-p 4] [-m 8]
        [--steps 4]

For each schedule (default 1F1B, 1F1B --evict, V-Half, ZB-H1): compile examples/gpt.py:tiny
with costs and stash bytes measured on this GPU (`--profile --device cuda`), train `--steps`
steps with `launch.py --share-gpu` and read each rank's real peak from OUT/measured/stats.json:
the CUDA caching allocator's bytes (`torch.cuda.max_memory_allocated`, every live tensor, the
peaks inside instructions included; the steps after the first, runtime/meter.py). Beside it
the prediction for the same run (runtime/measure.py's `predicted_peaks`: device cuda, gloo's
receive policy, all of a step's receives posted at its start), and real / predicted. Each
rank is a process of its own, so its allocator counts its own tensors only, though they share
the GPU. Without CUDA it says it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ itself, whose runtime.py would shadow the package

from gpu_pipeline import MODEL, compile_on_gpu, train_shared  # bench/gpu_pipeline.py

from runtime.measure import predicted_peaks

SCHEDULES = ("1f1b", "1f1b --evict", "v-half", "zb-h1")
MIB = 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("-p", type=int, default=4, help="ranks sharing the GPU (default 4)")
    ap.add_argument("-m", type=int, default=8, help="micro-batches (default 8)")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("cuda_memory: skipped: needs a CUDA GPU and torch sees none; nothing measured")
        return 0
    print(
        f"cuda_memory: {torch.cuda.get_device_name()}, {args.p} ranks sharing it (--share-gpu), "
        f"{MODEL.split('/')[-1]}, m={args.m}, real peak of steps 2..{args.steps}"
    )
    ratios = []
    with tempfile.TemporaryDirectory(prefix="cuda_memory_") as tmp:
        for schedule in args.schedules.split(","):
            build = Path(tmp) / schedule.replace(" ", "")
            result = compile_on_gpu(schedule, args.p, args.m, build)
            stats = train_shared(build, args.p, args.steps)
            c, costs = result.compiled, result.costs
            peaks = predicted_peaks(result.plan, c, costs, result.sim, "cuda", "gloo")
            for r, predicted in enumerate(peaks):
                real = stats["ranks"][r]["real_peak_bytes"]
                ratios.append(real / predicted.total)
                print(row(schedule, r, real, predicted.total))
    print(f"real/predicted peak over every rank: {min(ratios):.3f} to {max(ratios):.3f}")
    return 0


def row(schedule: str, rank: int, real: int, predicted: int) -> str:
    """One rank's figures (what `make gpu-check` quotes)."""
    return (
        f"{schedule:<13} rank {rank}: real peak {real / MIB:7.3f} MiB, predicted "
        f"{predicted / MIB:7.3f} MiB, real/predicted {real / predicted:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
