"""pipec's runtime against torch.distributed.pipelining: iteration time and memory, one command.

For each model (the tiny GPT and a larger CPU-sized one, examples/gpt.py) and each schedule
both have (1F1B, Interleaved1F1B, ZBV, DualPipeV), pipec compiles *torch's own order* for the
model, so both runtimes execute the same order over the same stage modules, micro-batches,
ranks and optimizer; `bench/torch_peer.py` runs them in one torchrun launch, steps alternating
pipec / torch (A B A B), and this script prints the median iteration time of each, the median
of the per-pair ratios pipec/torch with its interquartile spread, the CPU time of an iteration
(all ranks, all threads), the first step's losses
(equal when both compute the same thing) and each rank's peak saved-activation bytes, and the
floor: pipec's programs replayed by the simulator with the op durations pipec measured and
gloo's measured latency (bench/p2p_latency.py), plus the optimizer step, over torch's iteration.
No runtime that runs this order with these ops gets below it (the order's fill, drain and the
waits its messages' latency makes are in it); between the floor and the ratio is what pipec's
runtime adds: its loop, its sends, waits longer than the latency. That, step by step, is
"pipec / replay": each timed pipec step over its own replay (the programs played with that
step's op durations, runtime/measure.py, plus its optimizer step), the median: what pipec's
runtime added to that very step, whatever the host did to its ops meanwhile.
pipec's own v-half and zb-auto then run under pipec's runtime, alternating with torch's best
(the shared schedule whose order simulates shortest for the model).

    PYTHONPATH=. python bench/compare_torch.py            # both models, ~4 min on 2 cores
    PYTHONPATH=. python bench/compare_torch.py --quick    # tiny only, fewer pairs, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.runtime import activation_bytes, latency_ms, replay
from pipec.build_dir import emit, load
from pipec.model import compile_model, compile_model_torch_order
from pipec.runtime.torchrun import torchrun

#: Schedules both runtimes have: label, torch class, chunks per rank.
SHARED = (
    ("1F1B", "Schedule1F1B", 1),
    ("Interleaved1F1B", "ScheduleInterleaved1F1B", 2),
    ("ZBV", "ScheduleZBVZeroBubble", 2),
    ("DualPipeV", "ScheduleDualPipeV", 2),
)
#: pipec's own families measured against torch's fastest shared schedule.
OWN = ("v-half", "zb-auto")
MODELS = {"tiny": "examples/gpt.py:tiny", "small": "examples/gpt.py:small"}
PAIRS = {"tiny": 30, "small": 12}


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def compile_cases(models: list[str], p: int, m: int, out: Path) -> list[dict]:
    """Builds for every case; pipec's own families are paired with the torch schedule whose
    order simulates shortest under the model's costs (torch's best, chosen before measuring)."""
    cases = []
    for model in models:
        spec = f"{ROOT}/{MODELS[model]}"
        simulated = {}
        for label, cls, v in SHARED:
            result = compile_model_torch_order(spec, cls, p, m, v)
            directory = out / model / label
            emit(result, directory)
            simulated[(label, cls, str(directory))] = result.sim.makespan
            case = {"label": label, "torch": cls, "build": str(directory)}
            cases.append({"model": model, **case, "torch_build": str(directory)})
        label, cls, directory = min(simulated, key=simulated.__getitem__)
        for name in OWN:
            emit(compile_model(spec, name, p, m), out / model / name)
            case = {"label": name, "torch": cls, "torch_label": label, "torch_build": directory}
            cases.append({"model": model, **case, "build": str(out / model / name)})
    return cases


def floor_ms(r: dict, comm: float) -> float:
    """The iteration of pipec's order with no cost but its own ops and the latency: the
    build's programs replayed with the op durations pipec measured (medians) and gloo's
    measured latency, plus the slowest rank's optimizer step."""
    durations = {(op, int(s)): v for k, v in r["pipec_op_ms"].items() for op, s in [k.split()]}
    return replay(load(Path(r["build"])), durations, comm) + max(r["pipec_step_ms"])


def print_table(results: list[dict], p: int, m: int, latency: dict[str, dict]) -> None:
    said = ", ".join(
        f"{k} {v['bytes']} B in {v['busy_ms']:.2f} ms" for k, v in sorted(latency.items())
    )
    print(
        f"\n{p} ranks, m={m}, gloo, {os.cpu_count()} cores; ratio = median of the per-pair "
        "ratios pipec/torch (interquartile range); floor = pipec's order replayed with pipec's "
        "own op durations and gloo's latency (no wait, no runtime cost), plus its optimizer "
        "step, over torch's median iteration: the best any runtime reaches on this order with "
        "these ops; pipec / replay = median over pipec's steps of each over its own replay "
        f"(that step's op durations, no wait): what pipec's runtime added (one activation: {said})"
    )
    print(
        "| model | pipec | torch | pipec ms | torch ms | ratio (IQR) | floor | pipec / replay |"
        " CPU ms pipec / torch | first loss pipec / torch | peak saved MiB per rank pipec / torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 2.0**20
    for r in results:
        ratios = [a / b for a, b in zip(r["pipec_ms"], r["torch_ms"])]
        comm = latency[r["model"]]["busy_ms"]
        floor = floor_ms(r, comm) / statistics.median(r["torch_ms"])
        own = statistics.median(a / b for a, b in zip(r["pipec_ms"], r["pipec_replay_ms"]))
        lo, hi = _quartiles(ratios)
        med = {
            k: statistics.median(r[k])
            for k in ("pipec_ms", "torch_ms", "pipec_cpu_ms", "torch_cpu_ms")
        }
        peaks = [
            ", ".join(f"{x / mib:.2f}" for x in r[k])
            for k in ("pipec_peak_bytes", "torch_peak_bytes")
        ]
        ours = r["label"] if "torch_label" not in r else f"**{r['label']}**"
        print(
            f"| {r['model']} | {ours} | {r.get('torch_label', r['label'])} | "
            f"{med['pipec_ms']:.1f} | "
            f"{med['torch_ms']:.1f} | {statistics.median(ratios):.2f} ({lo:.2f}-{hi:.2f}) | "
            f"{floor:.2f} | {own:.2f} | "
            f"{med['pipec_cpu_ms']:.0f} / {med['torch_cpu_ms']:.0f} | "
            f"{r['first_loss'][0]:.4f} / {r['first_loss'][1]:.4f} | {peaks[0]} / {peaks[1]} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2: one per core)")
    ap.add_argument("--microbatches", "-m", type=int, default=8)
    ap.add_argument("--models", default="tiny,small", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per runtime and case")
    ap.add_argument("--quick", action="store_true", help="tiny model only, 10 pairs per case")
    args = ap.parse_args()
    models = ["tiny"] if args.quick else args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        sys.exit(f"compare_torch: unknown model {sorted(unknown)}; valid: {', '.join(MODELS)}")
    tmp = Path(tempfile.mkdtemp(prefix="pipec-vs-torch-"))
    cases = compile_cases(models, args.pp, args.microbatches, tmp)
    pairs = {k: 10 if args.quick else n for k, n in PAIRS.items()}
    latency = {}
    for model in models:  # between the first two stages, the size of one activation
        nbytes = activation_bytes(Path(next(c["build"] for c in cases if c["model"] == model)))
        print(f"latency of {nbytes} B under gloo ({model})", flush=True)
        latency[model] = latency_ms(nbytes, tmp / f"latency-{model}.json")
    job = tmp / "cases.json"
    comm = {model: v["busy_ms"] for model, v in latency.items()}
    job.write_text(
        json.dumps({"cases": cases, "warmup": args.warmup, "pairs": pairs, "latency_ms": comm})
    )
    cmd, env = torchrun(ROOT / "bench/torch_peer.py", args.pp, str(job), str(tmp / "results.json"))
    subprocess.run(cmd, env=env, check=True)
    results = json.loads((tmp / "results.json").read_text())
    print_table(results, args.pp, args.microbatches, latency)


if __name__ == "__main__":
    main()
