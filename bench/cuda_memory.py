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

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's pipec, bench and examples, installed or not

from gpu_pipeline import compile_on_gpu, shared_gpu_args, train_shared  # bench/gpu_pipeline.py

from pipec.runtime.measure import predicted_peaks

SCHEDULES = ("1f1b", "1f1b --evict", "v-half", "zb-h1")
MIB = 2**20


def main() -> int:
    args = shared_gpu_args("cuda_memory", __doc__, SCHEDULES, 4)
    if args is None:
        return 0
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
