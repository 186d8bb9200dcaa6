"""The tiny pipeline on one GPU, p ranks sharing it: measured vs simulated iteration time.

    PYTHONPATH=$PWD python bench/gpu_pipeline.py [--schedules 1f1b,zb-v] [-p 4] [-m 8]
        [--steps 20]

For each schedule (default 1F1B, ZB-V, V-Half, BitPipe, 1F1B --evict): compile
examples/gpt.py:tiny with F, B and W profiled on this GPU (`pipec compile --profile --device
cuda`: one process alone on the GPU); check one step's gradients against the single-process
reference (`launch.py --share-gpu --check-grads`); then train `--steps` steps with `launch.py
--share-gpu` (p ranks on the one GPU, gloo, every message staged through page-locked host
memory) and read OUT/measured/stats.json. Printed per schedule: the measured makespan (first
compute start to last compute end, median over the steps after the first) against the
simulated one (each rank on a GPU of its own), and against the shared-GPU bound, the sum of
every rank's measured busy time: without MPS the ranks' kernels take turns on the GPU, so no
makespan can be shorter. Exit code 1 when a gradient check failed. Without CUDA it says it
skipped and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's pipec, bench and examples, installed or not

from pipec.build_dir import emit
from pipec.compile import CompileResult
from pipec.model import compile_model
from pipec.runtime.torchrun import torchrun

MODEL = f"{ROOT}/examples/gpt.py:tiny"
SCHEDULES = ("1f1b", "zb-v", "v-half", "bitpipe", "1f1b --evict")


def compile_on_gpu(schedule: str, p: int, m: int, out: Path) -> CompileResult:
    """`schedule` ("name [--evict]") for the tiny GPT, profiled and measured on the GPU."""
    name, *flags = schedule.split()
    result = compile_model(MODEL, name, p, m, profile=True, evict="--evict" in flags, device="cuda")
    emit(result, out)
    return result


def launch_shared(build: Path, p: int, *args: str) -> subprocess.CompletedProcess:
    """`launch.py --share-gpu` on p local ranks; its output captured."""
    cmd, env = torchrun(build / "launch.py", p, "--share-gpu", *args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)


def gradients(build: Path, p: int) -> str:
    """'ok', or what `--check-grads` said went wrong."""
    proc = launch_shared(build, p, "--check-grads")
    if proc.returncode == 0 and "check-grads: ok" in proc.stdout:
        return "ok"
    said = [line for line in proc.stderr.splitlines() if "pipec runtime" in line]
    return "FAILED: " + (said[0] if said else f"exit {proc.returncode}")


def train_shared(build: Path, p: int, steps: int) -> dict:
    """Train `steps` steps with the ranks sharing the GPU; OUT/measured/stats.json."""
    proc = launch_shared(build, p, "--steps", str(steps))
    if proc.returncode != 0:
        sys.exit(f"bench: {build}: launch.py --share-gpu failed:\n{proc.stderr[-2000:]}")
    return json.loads((build / "measured/stats.json").read_text())


def shared_gpu_args(
    name: str, doc: str, schedules: tuple[str, ...], steps: int
) -> argparse.Namespace | None:
    """The command line of a shared-GPU bench; None (having said so) without CUDA. With CUDA
    the first line printed says what runs where."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--schedules", default=",".join(schedules))
    ap.add_argument("-p", type=int, default=4, help="ranks sharing the GPU (default 4)")
    ap.add_argument("-m", type=int, default=8, help="micro-batches (default 8)")
    ap.add_argument("--steps", type=int, default=steps)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"{name}: skipped: needs a CUDA GPU and torch sees none; nothing measured")
        return None
    print(
        f"{name}: {torch.cuda.get_device_name()}, {args.p} ranks sharing it (--share-gpu), "
        f"{MODEL.split('/')[-1]}, m={args.m}, {args.steps} steps, figures of steps 2.."
    )
    return args


def main() -> int:
    args = shared_gpu_args("gpu_pipeline", __doc__, SCHEDULES, 20)
    if args is None:
        return 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpu_pipeline_") as tmp:
        for schedule in args.schedules.split(","):
            build = Path(tmp) / schedule.replace(" ", "")
            compile_on_gpu(schedule, args.p, args.m, build)
            checked = gradients(build, args.p)
            failed |= checked != "ok"
            print(row(schedule, train_shared(build, args.p, args.steps), checked))
    return 1 if failed else 0


def row(schedule: str, stats: dict, checked: str) -> str:
    """One schedule's figures from its run's stats.json (what `make gpu-check` quotes)."""
    measured = stats["measured"]["makespan_ms"]
    simulated = stats["simulated"]["makespan_ms"]
    bound = sum(r["busy_ms"] for r in stats["ranks"])
    return (
        f"{schedule:<13} measured {measured:7.2f} ms  simulated {simulated:7.2f} ms  "
        f"measured/simulated {measured / simulated:5.2f}  shared-GPU bound "
        f"{bound:7.2f} ms  measured/bound {measured / bound:5.2f}  gradients {checked}"
    )


if __name__ == "__main__":
    sys.exit(main())
