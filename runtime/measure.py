"""What a run measured, beside what the simulator predicted: timeline, bubble, peak stash bytes.

Each rank turns its step traces into a `RankReport` (times in ms from the step's start, which
every rank takes right after a barrier); rank 0 gathers them and writes OUT/measured/:

    timeline.json  the last step as a Perfetto trace, the same format as OUT/timeline.json,
                   plus each rank's live stash bytes as a counter track
    stats.json     per step and median: iteration time, makespan, bubble; per rank: peak stash
                   bytes (measured by the saved-tensor hooks, all steps), busy, interpreter
                   overhead per instruction; and the simulator's figures for the same programs

Bubble is the simulator's definition, 1 - sum(busy) / (ranks * makespan), with busy the compute
instructions' time after their inputs arrived and makespan from the first compute start to the
last compute end over all ranks.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from codegen.render import chrome_trace, dump_json
from passes.simulate import SimResult, Slot
from pipec.ir import COMPUTE_OPS, Instr
from runtime.interpreter import StepTrace

MS = 1000.0


@dataclass(frozen=True)
class RankReport:
    """One rank's measurements, small enough to gather to rank 0."""

    rank: int
    peak_stash_bytes: int
    instructions: int
    steps: tuple[tuple[float, float, float, float], ...]
    """Per step: wall, busy, first compute start, last compute end (ms from the step start)."""
    slots: tuple[tuple[Instr, float, float], ...]  # the last step's compute instructions
    live: tuple[tuple[float, int], ...]  # the last step's live stash bytes after each instr
    overhead_us: float  # median over steps of the interpreter's own time per instruction


def rank_report(
    rank: int, program: tuple[Instr, ...], peak: int, traces: list[StepTrace]
) -> RankReport:
    steps = []
    for t in traces:
        compute = [
            (t.start[k] - t.begin, t.end[k] - t.begin)
            for k, i in enumerate(program)
            if i.op in COMPUTE_OPS
        ]
        busy = sum(e - s for s, e in compute)
        first = min((s for s, _ in compute), default=0.0)
        last = max((e for _, e in compute), default=0.0)
        steps.append((t.wall_s * MS, busy * MS, first * MS, last * MS))
    t = traces[-1]
    slots = tuple(
        (i, (t.start[k] - t.begin) * MS, (t.end[k] - t.begin) * MS)
        for k, i in enumerate(program)
        if i.op in COMPUTE_OPS
    )
    live = tuple(((t.end[k] - t.begin) * MS, t.live[k]) for k in range(len(program)))
    overhead = statistics.median((x.wall_s - x.handler_s) / len(program) * 1e6 for x in traces)
    return RankReport(rank, peak, len(program), tuple(steps), slots, live, overhead)


def summarize(reports: list[RankReport], sim: SimResult, cost_source: str, skip: int) -> dict:
    """Measured figures (median over steps after the first `skip`) beside the simulated ones."""
    n = len(reports[0].steps)
    kept = range(min(skip, n - 1), n)
    world = len(reports)
    per_step = []
    for k in kept:
        walls, busy, first, last = zip(*(r.steps[k] for r in reports))
        makespan = max(last) - min(first)
        bubble = 1 - sum(busy) / (world * makespan) if makespan > 0 else 0.0
        per_step.append({"iteration_ms": max(walls), "makespan_ms": makespan, "bubble": bubble})
    median = {key: statistics.median(s[key] for s in per_step) for key in per_step[0]}
    P = len(sim.ranks)
    ranks = []
    for r in reports:
        s = sim.ranks[r.rank % P]
        ranks.append(
            {
                "rank": r.rank,
                "peak_stash_bytes": r.peak_stash_bytes,
                "simulated_peak_stash_bytes": s.peak_stash_bytes,
                "busy_ms": statistics.median(r.steps[k][1] for k in kept),
                "simulated_busy_ms": s.busy,
                "overhead_us_per_instruction": r.overhead_us,
                "instructions": r.instructions,
            }
        )
    return {
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
    }


def timeline(reports: list[RankReport], title: str) -> dict:
    """The last step as a Perfetto trace (the simulated timeline's format) with stash counters."""
    origin = min((s for r in reports for _, s, _ in r.slots), default=0.0)
    slots = [[Slot(i, s - origin, e - origin) for i, s, e in r.slots] for r in reports]
    counters = [[(t - origin, b) for t, b in r.live] for r in reports]
    return chrome_trace(slots, f"{title} (measured)", counters)


def write(out: Path, stats: dict, trace: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "stats.json").write_text(dump_json(stats))
    (out / "timeline.json").write_text(json.dumps(trace, sort_keys=True))
