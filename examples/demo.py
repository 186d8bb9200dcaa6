"""`make demo`: compile a byte-level GPT for 4 ranks and train it on Shakespeare under torchrun.

    python examples/demo.py [--model SPEC] [--schedule NAME] [--ranks 4] [--microbatches 8]
                            [--steps 30] [--lr 3e-3]

Profiles the stages on this machine (one thread, as each rank runs), compiles, verifies and
simulates the schedule, writes build/demo/, then runs `pipec run build/demo` (torchrun on
build/demo/launch.py): the loss per step, falling from ln 256 = 5.55 (a byte-level model that
knows nothing) as it learns the text in examples/data/, a checkpoint in build/demo-ckpt/ at
the end, then the measured makespan, bubble and peak stash bytes beside the simulated.
The default schedule is v-half when this checkout has it, else 1f1b.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from pipec.build_dir import emit
from pipec.ir import PipecError
from pipec.model import compile_model
from pipec.passes.registry import SCHEDULES, family
from pipec.progress import progress
from pipec.runtime.torchrun import run_build

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    family("1f1b")  # registers the built-in families
    default = "v-half" if "v-half" in SCHEDULES else "1f1b"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=f"{ROOT}/examples/text.py:shakespeare", help="factory")
    ap.add_argument("--schedule", default=default, help=f"schedule family (default {default})")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "demo")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"compiling {args.model} with {args.schedule} for {args.ranks} ranks, "
        f"m={args.microbatches} (profiling each stage here)",
        flush=True,
    )
    try:
        with progress(f"compiling for {args.ranks} ranks"):  # a line every 5 s while it runs
            result = compile_model(
                args.model,
                args.schedule,
                args.ranks,
                args.microbatches,
                profile=True,
            )
            emit(result, args.out, force=True)
    except PipecError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    sim = result.sim
    print(
        f"wrote {args.out}: simulated makespan {sim.makespan:.1f} ms, bubble {sim.bubble:.3f}; "
        f"training {args.steps} steps under torchrun (gloo, CPU)",
        flush=True,
    )
    ckpt = args.out.with_name(args.out.name + "-ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    run_args = ("--steps", str(args.steps), "--lr", str(args.lr), "--threads", "1")
    return run_build(args.out, None, (*run_args, "--save", str(ckpt)))


if __name__ == "__main__":
    sys.exit(main())
