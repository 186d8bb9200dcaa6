"""Print a plan: the MFU curve, the ranked candidates, the 1F1B baseline and the verdict.

Each row puts the simulated speed-up over the baseline beside the paper's quick estimate,
MFU(row's mbs) / MFU(baseline's mbs) from the single-device profile (Huang et al., 2024): what
a larger micro-batch can gain at most from kernel efficiency alone. A memory-saving strategy
whose bound is near 1 cannot pay, whatever memory it frees. Each row's memory is its highest
rank's predicted peak; the chosen rows (row 1, and the row `--out` builds) are broken down per
rank and term. A calibrated plan states its expected error and marks rows predicted within it
of each other as ties (`=k`: tied with row k); an uncalibrated one says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipec.codegen.render import format_bytes
from pipec.passes.memory_bytes import TERMS
from pipec.passes.topology import Link
from pipec.plan.candidates import Evaluated, PlanRequest
from pipec.plan.conditions import Conditions
from pipec.plan.driver import Plan


@dataclass(frozen=True)
class Row:
    """A candidate's figures as printed: time in seconds, MFU of the whole world's peak."""

    ev: Evaluated
    tokens_per_s: float
    mfu: float
    speedup: float | None
    mfu_bound: float | None
    place: int = 0
    """The first row of its tie group (1-based); its own row when not tied."""
    tied: bool = False


def rows(plan: Plan) -> list[Row]:
    """Every fitting candidate, fastest first, with its derived figures."""
    prof, base, req = plan.profile, plan.baseline, plan.request
    world_peak = req.p * req.dp * prof.peak_flops
    fits = plan.evaluation.fits
    places = plan.places or tuple(range(1, len(fits) + 1))
    out = []
    for ev, place in zip(fits, places):
        out.append(
            Row(
                ev,
                tokens_per_s=req.global_batch * prof.tokens_per_sample / ev.iteration_s,
                mfu=req.global_batch * prof.flops_per_sample / ev.iteration_s / world_peak,
                speedup=base.iteration_s / ev.iteration_s if base else None,
                mfu_bound=prof.mfu(ev.mbs) / prof.mfu(base.mbs) if base else None,
                place=place,
                tied=places.count(place) > 1,
            )
        )
    return out


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _training(req: PlanRequest) -> str:
    """The precision and sharding priced, where not the default fp32 without ZeRO."""
    said = ([req.precision] if req.precision != "fp32" else []) + (["ZeRO-1"] if req.zero else [])
    return f" ({', '.join(said)})" if said else ""


def render_text(plan: Plan, top: int = 10, chosen: Sequence[int] = (1,)) -> str:
    """The human-readable report; the rows numbered in `chosen` (1: the best) get their
    predicted peak bytes per rank, by term."""
    prof, req = plan.profile, plan.request
    table, ties = rows(plan), plan.error is not None
    curve = "  ".join(f"{mbs}: {prof.mfu(mbs):.1%}" for mbs in prof.sizes)
    made = "the factory's" if prof.factory_sized else "the example resized"
    lines = [
        (
            f"pipec plan {prof.name}: p={req.p} dp={req.dp}{_training(req)}, global batch "
            f"{req.global_batch} ({prof.tokens_per_sample} tokens/sample), "
            f"{format_bytes(req.bytes_per_device)} per device"
        ),
        f"peak {prof.peak_flops / 1e12:.3g} TFLOP/s per device ({prof.peak_source})",
        _machine_line(plan),
        f"{'calibrated ' if plan.calibration else ''}MFU by micro-batch size ({made}): {curve}"
        + (f"  [stopped: {prof.stopped}]" if prof.stopped else ""),
        *calibration_lines(plan),
        "",
        (
            f"{'#':>3}  {'tie' if ties else '':<4}{'schedule':<14} {'strategy':<10} {'mbs':>4} "
            f"{'m':>5}  "
            f"{'iter time':>10}  {'tokens/s':>10}  {'MFU':>6}  {'bubble':>6}  "
            f"{'peak mem/rank':>13}  {'speedup':>7}  {'MFU bound':>9}"
        ),
    ]
    for k, row in enumerate(table[:top], 1):
        ev = row.ev
        mark = "*" if ev is plan.baseline else " "
        tie = (f"={row.place}" if row.tied else "") if ties else None
        lines.append(
            f"{k:>3}{mark} {'' if tie is None else f'{tie:<4}'}{ev.schedule:<14} "
            f"{ev.strategy:<10} {ev.mbs:>4} {ev.m:>5}  "
            f"{ev.iteration_s:>9.4g}s  {row.tokens_per_s:>10.4g}  {row.mfu:>6.1%}  "
            f"{ev.bubble:>6.1%}  {format_bytes(ev.peak_bytes):>13}  {_x(row.speedup):>7}  "
            f"{_x(row.mfu_bound):>9}"
        )
    if len(table) > top:
        lines.append(f"      … {len(table) - top} more that fit (--top shows more)")
    evaluation = plan.evaluation
    for k in sorted(set(chosen)):
        if k <= len(table):
            lines += ["", *_terms_table(k, table[k - 1].ev, plan.profile.device)]
    lines += ["", _baseline_line(plan), *_tie_line(plan, table), _verdict(table, plan.error)]
    fits, over, skipped = evaluation.fits, evaluation.over, evaluation.skipped
    lines.append(
        f"{len(fits)} candidates fit, {len(over)} over the budget, {len(skipped)} "
        "not applicable (--json lists them with the reason)"
    )
    return "\n".join(lines)


RUN_ON = {"cpu": "a CPU run (gloo, its heap meter)", "cuda": "a CUDA run (NCCL, its allocator)"}


def _terms_table(k: int, ev: Evaluated, device: str) -> list[str]:
    """Row `k`'s predicted peak bytes per rank, by term, for a run on the profiled device."""
    run = RUN_ON.get(device, f"a {device} run")
    title = f"row {k} ({ev.schedule} {ev.strategy}, mbs {ev.mbs}): peak bytes per rank"
    lines = [
        f"{title} predicted for {run}, by term:",
        f"  {'rank':>4}  {'peak':>10}  " + "  ".join(f"{t:>9}" for t in TERMS),
    ]
    for rank, mem in enumerate(ev.memory):
        cells = "  ".join(f"{format_bytes(getattr(mem, t)):>9}" for t in TERMS)
        lines.append(f"  {rank:>4}  {format_bytes(mem.total):>10}  {cells}")
    return lines


def _machine_line(plan: Plan) -> str:
    topo, req, cal = plan.request.machine, plan.request, plan.calibration
    if cal is not None and cal.link is not None and topo is not None:
        latency, bandwidth = cal.link
        if topo.nodes == 1 and topo.intra == Link(bandwidth, latency):
            rate = "" if math.isinf(bandwidth) else f" + bytes at {bandwidth / 1e9:.3g} GB/s"
            return (
                f"transfers: {latency * 1e6:.3g} us{rate} each (measured between ranks 0 and 1 "
                "in the calibration run)"
            )
    if topo is None:
        return f"transfers: {req.comm_s:g} s each (--comm; --nodes/--link price them by link)"

    def link(k: Link) -> str:
        return f"{k.bandwidth / 1e9:.3g} GB/s + {k.latency * 1e6:.3g} us"

    inter = f", inter-node {link(topo.inter)}" if topo.nodes > 1 else ""
    return (
        f"machine: {topo.nodes} node(s) x {topo.gpus_per_node} GPUs; intra-node "
        f"{link(topo.intra)}{inter} per transfer"
    )


def calibration_lines(plan: Plan) -> list[str]:
    """Where the plan's times come from and how far to trust them."""
    cal = plan.calibration
    if cal is None:
        under = plan.profile.conditions
        alone = f" ({under.text()})" if under else ""
        said = (
            f"uncalibrated: each op timed alone{alone}, not as a run executes it; a run is "
            "usually slower, by an amount that differs between schedules; no ties marked "
            "(docs/plan.md)"
        )
        return [said, *busy(under)]
    sizes = sorted({n for n, _, _ in cal.factors})
    by_size = "  ".join(
        f"{n}: " + " ".join(f"{k} {f:.2f}" for m, k, f in cal.factors if m == n) for n in sizes
    )
    sources = ", ".join(source.split(" (")[0] for source, *_ in cal.runs)
    came = (
        f"calibrated from {len(cal.runs)} run(s) ({sources}): measured / profiled by mbs "
        f"{by_size}; optimizer {cal.optimizer:.2f}; us per instruction "
        + "  ".join(f"{n}: {x * 1e6:.1f}" for n, x in cal.instr_s)
    )
    error = (
        f"expected error {cal.error:.1%}: the model alone missed the runs by up to "
        f"{cal.model_miss:.1%}, a correction carried to another size by {cal.residual:.1%}; "
        f"a run's median uncertain by {cal.spread:.1%}; rows within it of each other are ties "
        "(=k)"
    )
    under = [] if cal.conditions is None else [f"measured with {cal.conditions.text()}"]
    return [came, error, *under, *busy(cal.conditions)]


def busy(conditions: Conditions | None) -> list[str]:
    """A warning when other work loaded the machine while the plan measured it."""
    if conditions is None or conditions.load <= conditions.cores:
        return []
    said = (
        f"warning: the machine's load ({conditions.load:.1f}) exceeded its {conditions.cores} "
        "cores while the plan measured: its times describe that load; plan again on a quiet "
        "machine"
    )
    return [said]


def _tie_line(plan: Plan, table: list[Row]) -> list[str]:
    """Whether row 1 is ahead of the rest by more than the expected error."""
    if plan.error is None or not table:
        return []
    error = f"the expected error ({plan.error:.1%})"
    tied = [k for k, row in enumerate(table, 1) if row.place == 1]
    if len(tied) == 1:
        return [f"row 1 is faster than every other row by more than {error}"]
    first = table[0].ev
    said = (
        f"rows 1-{tied[-1]} are tied (each within {error} of the next): the plan does not rank "
        f"them; row 1, {first.schedule} {first.strategy} at mbs {first.mbs}, is the simplest "
        "within the error of the fastest"
    )
    return [said]


def _baseline_line(plan: Plan) -> str:
    base = plan.baseline
    if base is None:
        return "* baseline: plain 1F1B fits at no micro-batch size; speed-ups are not defined"
    return (
        f"* baseline: plain 1F1B at mbs {base.mbs}, the largest that fits "
        f"({format_bytes(base.peak_bytes)} peak): {base.iteration_s:.4g} s per iteration"
    )


def _verdict(table: list[Row], error: float | None = None) -> str:
    """Whether saving memory pays: the best memory-saving candidate against the best plain."""
    plain = next((r for r in table if r.ev.strategy == "plain"), None)
    saving = next((r for r in table if r.ev.strategy != "plain"), None)
    if saving is None:
        return "memory saving: no memory-saving candidate fits"
    if plain is None:
        return "memory saving is needed: no plain schedule fits"
    gain = plain.ev.iteration_s / saving.ev.iteration_s
    verb = "pays" if gain > 1 else "does not pay"
    if error is not None and max(gain, 1 / gain) <= 1 + error:
        verb = f"is a tie (within the expected error, {error:.1%})"
    return (
        f"memory saving {verb}: best {saving.ev.strategy} ({saving.ev.schedule}, mbs "
        f"{saving.ev.mbs}) is {gain:.2f}x the best plain ({plain.ev.schedule}, mbs "
        f"{plain.ev.mbs}); MFU bound of its mbs over the baseline's {_x(saving.mfu_bound)}"
    )


def render_json(plan: Plan, command: Callable[[Evaluated], str] | None = None) -> dict:
    """One JSON-serialisable object for scripts: inputs, profile, ranked candidates, the rest;
    with `command`, each candidate also carries the `pipec compile` line that builds it."""
    prof, ev, req = plan.profile, plan.evaluation, plan.request

    def cand(e: Evaluated) -> dict:
        return ({"command": command(e)} if command else {}) | {
            "family": e.family,
            "schedule": e.schedule,
            "strategy": e.strategy,
            "mbs": e.mbs,
            "m": e.m,
            "compile": e.request.to_json(),
            "iteration_s": e.iteration_s,
            "bubble": e.bubble,
            "peak_bytes": e.peak_bytes,
            "memory": [{"rank": k} | r.to_json() for k, r in enumerate(e.memory)],
        }

    return {
        "model": prof.name,
        "p": req.p,
        "dp": req.dp,
        "precision": req.precision,
        "zero": int(req.zero),
        "global_batch": req.global_batch,
        "memory_per_device": req.bytes_per_device,
        "comm_s": req.comm_s,
        "machine": req.machine.to_json() if req.machine else None,
        "memory_device": prof.device,
        "peak_flops": prof.peak_flops,
        "peak_source": prof.peak_source,
        "tokens_per_sample": prof.tokens_per_sample,
        "flops_per_sample": prof.flops_per_sample,
        "profile": [
            {
                "mbs": pt.mbs,
                "mfu": prof.mfu(pt.mbs),
                "seconds": {k: sum(getattr(s, k) for s in pt.seconds) for k in "FBW"},
                "stash_bytes": sum(pt.stash_bytes),
            }
            for pt in prof.points
        ],
        "profile_stopped": prof.stopped,
        "profile_factory_sized": prof.factory_sized,
        "calibration": None if plan.calibration is None else plan.calibration.to_json(),
        "expected_error": plan.error,
        "baseline": cand(plan.baseline) if plan.baseline else None,
        "candidates": [
            cand(r.ev)
            | {
                "tokens_per_s": r.tokens_per_s,
                "mfu": r.mfu,
                "speedup": r.speedup,
                "mfu_bound": r.mfu_bound,
                "place": r.place,
                "tied": r.tied,
            }
            for r in rows(plan)
        ],
        "over_budget": [cand(e) for e in ev.over],
        "skipped": [
            {"family": s.family, "strategy": s.strategy, "mbs": s.mbs, "reason": s.reason}
            for s in ev.skipped
        ],
    }
