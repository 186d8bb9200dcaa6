"""Stash memory: V-Min's rank-0 peak against 1F1B's, simulated for each p, measured at 8 ranks.

Simulated: for p = 4 .. --max-p, a GPT of the tiny config's width with 2p layers (one layer per
V-Min chunk, two per 1F1B stage; stash bytes measured by the frontend), m = 2p. Prints rank 0's
peak in stashes and in bytes for both schedules, the byte ratio, and the bound of
docs/memory.md, (p+4)//3 / p, which is the busiest rank's (rank 0 can hold one stash fewer).

Run (--run): compile examples/gpt.py:deep (16 narrow layers) for 1F1B, 1F1B --evict and V-Min
at p=8, m=16, train three steps of each under torchrun (gloo, CPU) through OUT/launch.py, and
print every rank's stash counter (the bytes the runtime books for stashes) beside the
simulator's stash peak, then rank 0's ratios in counted stash bytes and in measured real
activation bytes (the real peak less parameters, gradients and optimizer state; the meter,
runtime/meter.py). bench/memory.py compares whole real peaks with their prediction.

    PYTHONPATH=. python bench/stash.py [--max-p 16] [--run]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt import TINY, GPTConfig, make_spec
from pipec.build_dir import emit
from pipec.compile import compile_schedule
from pipec.frontend import build_model_plan
from pipec.model import compile_model, model_costs
from pipec.passes.costs import CostModel
from pipec.passes.registry import family
from pipec.runtime.torchrun import torchrun

DEEP = f"{ROOT}/examples/gpt.py:deep"
RUN_P, RUN_M = 8, 16
RUNS = {"1f1b": {}, "1f1b --evict": {"evict": True}, "v-min": {}}


def rank0_peak(schedule: str, p: int, m: int, cfg: GPTConfig) -> tuple[float, float]:
    """Rank 0's simulated peak (stashes, bytes) with the frontend's stash bytes of `cfg`."""
    v = family(schedule).default_v
    model = build_model_plan(make_spec(cfg), p * v, "uniform", v=v, progress=False).to_json()
    result = compile_schedule(schedule, p, m, v, model_costs(model, CostModel()), model=model)
    rank0 = result.sim.ranks[0]
    return rank0.peak_activations, rank0.peak_stash_bytes


def simulated(max_p: int) -> None:
    print(f"simulated, tiny GPT width (d={TINY.d_model}), 2p layers, m = 2p")
    print("| p | 1F1B rank 0 stashes | V-Min rank 0 stashes | V-Min / 1F1B bytes | (p+4)//3 / p |")
    print("|---|---|---|---|---|")
    for p in range(4, max_p + 1):
        cfg = GPTConfig(**{**TINY.__dict__, "n_layers": 2 * p})
        (a, a_bytes), (b, b_bytes) = (rank0_peak(f, p, 2 * p, cfg) for f in ("1f1b", "v-min"))
        print(f"| {p} | {a:g} | {b:g} | {b_bytes / a_bytes:.3f} | {(p + 4) // 3 / p:.3f} |")


def measured() -> None:
    stats = {}
    with tempfile.TemporaryDirectory(prefix="pipec-stash-") as tmp:
        for k, (name, options) in enumerate(RUNS.items()):
            build = Path(tmp) / f"run{k}"
            emit(compile_model(DEEP, name.split()[0], RUN_P, RUN_M, **options), build)
            cmd, env = torchrun(build / "launch.py", RUN_P, "--steps", "3", "--threads", "1")
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            stats[name] = json.loads((build / "measured/stats.json").read_text())["ranks"]
    print(f"\nexamples/gpt.py:deep, p={RUN_P}, m={RUN_M}, three steps, gloo")
    print("| rank | " + " | ".join(f"{n} counter / simulated bytes" for n in RUNS) + " |")
    print("|---|" + "---|" * len(RUNS))
    for r in range(RUN_P):
        cells = (
            f"{s[r]['peak_stash_bytes']} / {s[r]['simulated_peak_stash_bytes']:.0f}"
            for s in stats.values()
        )
        print(f"| {r} | " + " | ".join(cells) + " |")
    counted = {n: s[0]["peak_stash_bytes"] for n, s in stats.items()}
    real = {
        n: s[0]["real_peak_bytes"] - s[0]["model_state_at_peak_bytes"] for n, s in stats.items()
    }
    for name, figures in (("stash counter", counted), ("measured real activations", real)):
        print(
            f"\nrank 0, {name}: V-Min / 1F1B {figures['v-min'] / figures['1f1b']:.3f}, "
            f"1F1B --evict / 1F1B {figures['1f1b --evict'] / figures['1f1b']:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-p", type=int, default=16)
    ap.add_argument("--run", action="store_true", help=f"also measure at p={RUN_P} (torchrun)")
    args = ap.parse_args()
    simulated(args.max_p)
    if args.run:
        measured()


if __name__ == "__main__":
    main()
