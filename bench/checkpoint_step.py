"""A step that saves a checkpoint against a step that does not (runtime/saving.py).

For the tiny and small GPTs of examples/gpt.py, compiled for 1F1B at p=2, m=4, one torchrun
launch of 2 gloo ranks each (bench/checkpoint_step_worker.py) trains in turns, A B A B …, each
saving after every `--every`-th step: `async` as launch.py does (the state copied to host
memory in the step, written in the background), `sync` waiting for the write in the step. A
step's time is its whole iteration on the slower rank (the program, the figures' gather, the
save's part, the next barrier). Each saving step is compared with the step just before it,
which saves nothing and ran under the same load a moment earlier (this machine's load from
other processes drifts over seconds; a pair does not). Reported per model and turn, the
medians over all pairs of:

- saving / plain: a saving step's time over the step before it (docs/training.md quotes the
  async figure);
- after / plain: the step after a saving step over the same plain step: what the write going
  on in the background costs the step it overlaps.

    PYTHONPATH=. python bench/checkpoint_step.py [--rounds 4] [--steps 12] [--every 4]
                                                 [--models tiny,small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipec.build_dir import emit
from pipec.model import compile_model
from pipec.runtime.torchrun import torchrun

WORKER = ROOT / "bench/checkpoint_step_worker.py"


def measure(model: str, rounds: int, steps: int, every: int, tmp: Path) -> dict[str, float]:
    """One launch of the worker on `model`'s build; the ratios above."""
    build = tmp / model / "build"
    emit(compile_model(f"{ROOT}/examples/gpt.py:{model}", "1f1b", 2, 4), build)
    out = tmp / model / "times.json"
    args = (str(build), str(rounds), str(steps), str(every), str(tmp / model / "ck"), str(out))
    cmd, env = torchrun(WORKER, 2, *args)
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    ranks = json.loads(out.read_text())
    ratios, plain = {}, []
    for turn in ranks[0]:
        saving, after = [], []
        for k, pairs in enumerate(ranks[0][turn]):
            slowest = {
                step: max(r[turn][k][i][1] for r in ranks) for i, (step, _) in enumerate(pairs)
            }
            for step, t in slowest.items():
                if step % every == 0 and step - 1 in slowest and step + 1 in slowest:
                    plain.append(slowest[step - 1])
                    saving.append(t / slowest[step - 1])
                    after.append(slowest[step + 1] / slowest[step - 1])
        ratios[f"{turn}: saving / plain"] = statistics.median(saving)
        ratios[f"{turn}: after / plain"] = statistics.median(after)
    return {"plain step ms": statistics.median(plain) * 1000} | ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="turns of each kind (default 4)")
    ap.add_argument("--steps", type=int, default=12, help="measured steps per turn (default 12)")
    ap.add_argument("--every", type=int, default=4, help="save after every K-th step (4)")
    ap.add_argument("--models", default="tiny,small", help="examples/gpt.py factories")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pipec-bench-"))
    rows = {m: measure(m, args.rounds, args.steps, args.every, tmp) for m in args.models.split(",")}
    print(
        f"\n1F1B p=2 m=4, 2 gloo ranks, a checkpoint every {args.every} steps; {args.rounds} "
        f"turns x {args.steps} steps of each kind; medians over the pairs of the slower rank's "
        "iterations"
    )
    columns = list(next(iter(rows.values())))
    print("| model | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for model, row in rows.items():
        print(f"| {model} | " + " | ".join(f"{v:.3g}" for v in row.values()) + " |")


if __name__ == "__main__":
    main()
