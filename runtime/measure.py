"""What a run measured, beside what the simulator predicted: timeline, bubble, peak bytes.

Each rank turns its step traces into a `RankReport` (times in ms from the step's start, which
every rank takes right after a barrier); rank 0 gathers them and writes OUT/measured/:

    timeline.json  the last step as a Perfetto trace, the same format as OUT/timeline.json,
                   plus each rank's memory as a counter track: real bytes (the meter,
                   runtime/meter.py) and the stash counter
    stats.json     per step and median: iteration time, makespan, bubble; per rank: the real
                   peak bytes (the meter's, highest over the measured steps) and the
                   parameters, gradients and optimizer state alive at that peak; the stash
                   counter's peak (the bytes the runtime books for stashes: autograd's saved
                   tensors, what moved by EVICT/LOAD, accepted and deferred-W bytes, all
                   steps); busy time, interpreter overhead per instruction, the rank's
                   own time per instruction beside compute, waits and the optimizer step
                   (the loop, sends, posted receives) and the optimizer step's time; each
                   compute op kind's median duration per stage (`ops`); the replay
                   (each step's compute instructions played by the simulator with their own
                   measured durations and the build's message latency: the step with no wait
                   but the latency, so makespan / replay is what the runtime added beyond
                   the ops themselves); and the simulator's figures for the same programs.
                   `device` says which meter read it, `backend` (written by the entry
                   point) where receives were posted.

Bubble is the simulator's definition, 1 - sum(busy) / (ranks * makespan), with busy the compute
instructions' time after their inputs arrived and makespan from the first compute start to the
last compute end over all ranks.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from operator import sub
from pathlib import Path

from pipec.codegen.render import chrome_trace, dump_json
from pipec.ir import COMPUTE_OPS, Compiled, Instr, Op, op_kinds
from pipec.passes.costs import CostModel
from pipec.passes.memory_bytes import ByteFacts, RankBytes, at_precision, for_device, predict_peaks
from pipec.passes.simulate import Node, SimResult, Slot, play, simulate
from pipec.runtime.calibration import GLOO_RECV_HOST
from pipec.runtime.interpreter import StepTrace
from pipec.runtime.meter import stash_extras

MS = 1000.0


@dataclass(frozen=True)
class RankReport:
    """One rank's measurements, small enough to gather to rank 0."""

    rank: int
    peak_stash_bytes: int
    instructions: int
    steps: tuple[tuple[float, float, float, float], ...]
    """Per step: wall, busy, first compute start, last compute end (ms from the step start)."""
    memory: tuple[tuple[int, int], ...]
    """Per step: real peak bytes, and the parameters, gradients and optimizer state at it."""
    ops: tuple[tuple[float, ...], ...]
    """Per step: each compute instruction's duration (ms), in program order."""
    slots: tuple[tuple[Instr, float, float], ...]  # the last step's compute instructions
    live: tuple[tuple[float, int, int], ...]  # last step, after each instr: time, counter, real
    overhead_us: float  # median over steps of the interpreter's own time per instruction
    device: str  # "cpu" or "cuda": which meter read the real bytes
    own: tuple[tuple[float, float], ...] = ()
    """Per step: the rank's own time per instruction (us) beside its compute, its waits, its
    all-reduces and its optimizer step (the loop, issuing sends, posting receives), and the
    optimizer step's time (ms)."""


def rank_report(
    rank: int, program: tuple[Instr, ...], peak: int, traces: list[StepTrace], device: str
) -> RankReport:
    steps, ops, own = [], [], []
    compute_at = [k for k, i in enumerate(program) if i.op in COMPUTE_OPS]
    optimizer_at = [k for k, i in enumerate(program) if i.op is Op.OPTIMIZER_STEP]
    # Issuing an all-reduce packs the gradients: a collective's cost, not the interpreter's.
    collective_at = [k for k, i in enumerate(program) if i.op is Op.ALLREDUCE_GRADS]
    for t in traces:
        compute = [(t.start[k] - t.begin, t.end[k] - t.begin) for k in compute_at]
        busy = sum(e - s for s, e in compute)
        first = min((s for s, _ in compute), default=0.0)
        last = max((e for _, e in compute), default=0.0)
        steps.append((t.wall_s * MS, busy * MS, first * MS, last * MS))
        ops.append(tuple((e - s) * MS for s, e in compute))
        worked = sum(map(sub, t.end, t.start))  # every handler's time less its waits
        optimizer = sum(t.end[k] - t.start[k] for k in optimizer_at)
        waits = t.handler_s - worked
        collectives = sum(t.end[k] - t.start[k] for k in collective_at)
        rest = t.wall_s - waits - busy - optimizer - collectives
        own.append((rest / len(program) * 1e6, optimizer * MS))
    t = next(x for x in reversed(traces) if x.full)  # the last, unless a signal stopped the run
    slots = tuple(
        (i, (t.start[k] - t.begin) * MS, (t.end[k] - t.begin) * MS)
        for k, i in enumerate(program)
        if i.op in COMPUTE_OPS
    )
    live = tuple(((t.end[k] - t.begin) * MS, t.live[k], t.real[k]) for k in range(len(program)))
    overhead = statistics.median((x.wall_s - x.handler_s) / len(program) * 1e6 for x in traces)
    memory = tuple((x.real_peak, x.state_at_peak) for x in traces)
    return RankReport(
        rank,
        peak,
        len(program),
        tuple(steps),
        memory,
        tuple(ops),
        slots,
        live,
        overhead,
        device,
        tuple(own),
    )


def replayed_ms(ops: Mapping[int, Sequence[float]], compiled: Compiled, costs: CostModel) -> float:
    """Makespan of the programs played with one step's measured op durations (`ops`: rank ->
    its compute instructions' durations in ms, in program order; with data parallelism each
    op's slowest copy counts) and `costs`' message latency: the step without any wait beyond
    the latency, the runtime's or the host's."""
    programs = compiled.programs
    costs = replace(costs, instr_overhead=0.0)  # the runtime's own time is what this measures
    measured: dict[Node, float] = {}
    for rank, durations in ops.items():
        compute = [i for i in programs[rank % len(programs)] if i.op in COMPUTE_OPS]
        for i, ms in zip(compute, durations, strict=True):
            node = (i.op, i.stage, i.mb)
            measured[node] = max(ms, measured.get(node, 0.0))
    times = play(compiled.layout, programs, costs, measured=measured).times.values()
    return max(e for _, e in times) - min(s for s, _ in times)


def summarize(
    reports: list[RankReport], compiled: Compiled, costs: CostModel, cost_source: str, skip: int
) -> dict:
    """Measured figures (median over steps after the first `skip`) beside the simulated ones."""
    sim = simulate(compiled.layout, compiled.programs, costs)
    n = len(reports[0].steps)
    kept = range(min(skip, n - 1), n)
    world = len(reports)
    per_step = []
    for k in kept:
        walls, busy, first, last = zip(*(r.steps[k] for r in reports))
        makespan = max(last) - min(first)
        bubble = 1 - sum(busy) / (world * makespan) if makespan > 0 else 0.0
        replay = replayed_ms({r.rank: r.ops[k] for r in reports}, compiled, costs)
        per_step.append(
            {
                "iteration_ms": max(walls),
                "makespan_ms": makespan,
                "bubble": bubble,
                "replay_ms": replay,
                "makespan_over_replay": makespan / replay if replay > 0 else 1.0,
            }
        )
    median = {key: statistics.median(s[key] for s in per_step) for key in per_step[0]}
    P = len(sim.ranks)
    ranks = []
    for r in reports:
        s = sim.ranks[r.rank % P]
        real, state = max(r.memory[k] for k in kept)
        ranks.append(
            {
                "rank": r.rank,
                "real_peak_bytes": real,
                "model_state_at_peak_bytes": state,
                "peak_stash_bytes": r.peak_stash_bytes,
                "simulated_peak_stash_bytes": s.peak_stash_bytes,
                "busy_ms": statistics.median(r.steps[k][1] for k in kept),
                "simulated_busy_ms": s.busy,
                "overhead_us_per_instruction": r.overhead_us,
                "instructions": r.instructions,
            }
            | _own_time(r, kept)
        )
    return {
        "device": reports[0].device,
        "steps": n,
        "steps_measured": len(per_step),
        "measured": median,
        "per_step": per_step,
        "simulated": {
            "makespan_ms": sim.makespan,
            "bubble": sim.bubble,
            "cost_source": cost_source,
        },
        "ranks": ranks,
        "ops": op_medians(reports, compiled, kept),
    }


def _own_time(r: RankReport, kept: range) -> dict:
    """The rank's own time per instruction and its optimizer step's time, medians over the
    kept steps (none from a report without them)."""
    if not r.own:
        return {}
    return {
        "own_us_per_instruction": statistics.median(r.own[k][0] for k in kept),
        "optimizer_ms": statistics.median(r.own[k][1] for k in kept),
    }


def op_medians(reports: list[RankReport], compiled: Compiled, kept: range) -> list[dict]:
    """Each compute op kind of each stage: its median duration in ms over the kept steps and
    every micro-batch (and data-parallel copy), and how many durations that is: what a run
    measured, which `pipec plan --calibrate` folds back into a plan and `pipec show` compares
    with the build's costs."""
    programs = compiled.programs
    found: dict[tuple[str, int], list[float]] = {}
    for r in reports:
        compute = [i for i in programs[r.rank % len(programs)] if i.op in COMPUTE_OPS]
        for k in kept:
            for instr, ms in zip(compute, r.ops[k], strict=True):
                found.setdefault((instr.op.value, instr.stage), []).append(ms)
    return [
        {"op": op, "stage": stage, "ms": statistics.median(ms), "count": len(ms)}
        for (op, stage), ms in sorted(found.items())
    ]


def kind_ratios(stats: dict, compiled: Compiled, costs: CostModel) -> dict[str, float]:
    """Per compute op kind the run executed, measured / predicted: its median durations per
    stage (`op_medians`, in stats.json) summed over the stages, over the build's costs for
    the same ops (`pipec show`'s check of the costs a build was priced with)."""
    costs = costs.of_chunks(compiled.layout.stash_share)
    sums: dict[str, list[float]] = {}
    for op in stats.get("ops", ()):
        predicted = costs.duration(Instr(Op(op["op"]), op["stage"]), compiled.layout)
        pair = sums.setdefault(op["op"], [0.0, 0.0])
        pair[0] += op["ms"]
        pair[1] += predicted
    return {kind: m / p for kind, (m, p) in sorted(sums.items()) if p > 0}


def timeline(reports: list[RankReport], title: str) -> dict:
    """The last step as a Perfetto trace (the simulated timeline's format) with memory counters."""
    origin = min((s for r in reports for _, s, _ in r.slots), default=0.0)
    slots = [[Slot(i, s - origin, e - origin) for i, s, e in r.slots] for r in reports]
    counters = [
        [(t - origin, {"real bytes": real, "stash counter bytes": b}) for t, b, real in r.live]
        for r in reports
    ]
    return chrome_trace(slots, f"{title} (measured)", counters)


def write(out: Path, stats: dict, trace: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "stats.json").write_text(dump_json(stats))
    (out / "timeline.json").write_text(json.dumps(trace, sort_keys=True))


def predicted_peaks(
    plan: dict,
    compiled: Compiled,
    costs: CostModel,
    sim: SimResult,
    device: str,
    backend: str | None = None,
    spec: str | None = None,
    precision: str = "fp32",
    zero: int = 1,
) -> tuple[RankBytes, ...]:
    """The prediction (passes/memory_bytes.py) for a run on `device` with `backend`'s receive
    policy (default: gloo on CPU, NCCL on CUDA; gloo on CUDA is `launch.py --share-gpu`). On
    CPU it runs the model once per chunk for what the meter sees beyond the frontend's stash
    bytes (`stash_extras`): autograd's host bytes and, with the B/W split, what W holds; and it
    counts each posted gloo receive's host bytes. On CUDA
    none of these: host bytes are not device bytes, and building the whole model on the host
    is what a GPU run avoids; W then holds the simulator's share. `spec`: where the model's
    factory is, if not the plan's spec as written (`pipec.provenance.resolve`). `precision`
    and `zero` (the data-parallel copies ZeRO-1 shards over; 1: none) are the run's
    (`at_precision`)."""
    if device == "cpu":
        extras = stash_extras(plan, bool({Op.B, Op.W} & op_kinds(compiled.programs)), spec)
        facts = ByteFacts.from_plan(plan, extras.host, extras.w_held, GLOO_RECV_HOST.value)
    else:
        facts = ByteFacts.from_plan(plan)
    facts, ahead = for_device(facts, device, backend)
    facts, costs = at_precision(facts, costs, precision, zero, plan.get("precision", "fp32"))
    return predict_peaks(compiled.layout, compiled.programs, costs, sim, facts, ahead)


def memory_rows(peaks: tuple[RankBytes, ...], stats: dict | None) -> list[dict]:
    """Per rank: predicted peak bytes (and terms) and, after a run, the real peak and the
    ratio real / predicted (`pipec show`'s table and --json)."""
    rows = []
    for r, peak in enumerate(peaks):
        row = {"rank": r, "predicted_peak_bytes": peak.total, "predicted": peak.to_json()}
        if stats is not None:
            real = stats["ranks"][r]["real_peak_bytes"]
            row |= {"real_peak_bytes": real, "ratio": real / peak.total}
        rows.append(row)
    return rows
