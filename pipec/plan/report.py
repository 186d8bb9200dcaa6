"""Print a plan: the MFU curve, the ranked candidates, the 1F1B baseline and the verdict.

Each row puts the simulated speed-up over the baseline beside the paper's quick estimate,
MFU(row's mbs) / MFU(baseline's mbs) from the single-device profile (Huang et al., 2024): what
a larger micro-batch can gain at most from kernel efficiency alone. A memory-saving strategy
whose bound is near 1 cannot pay, whatever memory it frees. Each row's memory is its highest
rank's predicted peak; the chosen rows (row 1, and the row `--out` builds) are broken down per
rank and term.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipec.codegen.render import format_bytes
from pipec.passes.memory_bytes import TERMS
from pipec.passes.topology import Link
from pipec.plan.candidates import Evaluated, PlanRequest
from pipec.plan.driver import Plan


@dataclass(frozen=True)
class Row:
    """A candidate's figures as printed: time in seconds, MFU of the whole world's peak."""

    ev: Evaluated
    tokens_per_s: float
    mfu: float
    speedup: float | None
    mfu_bound: float | None


def rows(plan: Plan) -> list[Row]:
    """Every fitting candidate, fastest first, with its derived figures."""
    prof, base, req = plan.profile, plan.baseline, plan.request
    world_peak = req.p * req.dp * prof.peak_flops
    out = []
    for ev in plan.evaluation.fits:
        out.append(
            Row(
                ev,
                tokens_per_s=req.global_batch * prof.tokens_per_sample / ev.iteration_s,
                mfu=req.global_batch * prof.flops_per_sample / ev.iteration_s / world_peak,
                speedup=base.iteration_s / ev.iteration_s if base else None,
                mfu_bound=prof.mfu(ev.mbs) / prof.mfu(base.mbs) if base else None,
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
        f"profiled MFU by micro-batch size ({made}): {curve}"
        + (f"  [stopped: {prof.stopped}]" if prof.stopped else ""),
        "",
        (
            f"{'#':>3}  {'schedule':<14} {'strategy':<10} {'mbs':>4} {'m':>5}  "
            f"{'iter time':>10}  {'tokens/s':>10}  {'MFU':>6}  {'bubble':>6}  "
            f"{'peak mem/rank':>13}  {'speedup':>7}  {'MFU bound':>9}"
        ),
    ]
    table = rows(plan)
    for k, row in enumerate(table[:top], 1):
        ev = row.ev
        mark = "*" if ev is plan.baseline else " "
        lines.append(
            f"{k:>3}{mark} {ev.schedule:<14} {ev.strategy:<10} {ev.mbs:>4} {ev.m:>5}  "
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
    lines += ["", _baseline_line(plan), _verdict(table)]
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
    topo, req = plan.request.machine, plan.request
    if topo is None:
        return f"transfers: {req.comm_s:g} s each (--comm; --nodes/--link price them by link)"

    def link(k: Link) -> str:
        return f"{k.bandwidth / 1e9:.3g} GB/s + {k.latency * 1e6:.3g} us"

    inter = f", inter-node {link(topo.inter)}" if topo.nodes > 1 else ""
    return (
        f"machine: {topo.nodes} node(s) x {topo.gpus_per_node} GPUs; intra-node "
        f"{link(topo.intra)}{inter} per transfer"
    )


def _baseline_line(plan: Plan) -> str:
    base = plan.baseline
    if base is None:
        return "* baseline: plain 1F1B fits at no micro-batch size; speed-ups are not defined"
    return (
        f"* baseline: plain 1F1B at mbs {base.mbs}, the largest that fits "
        f"({format_bytes(base.peak_bytes)} peak): {base.iteration_s:.4g} s per iteration"
    )


def _verdict(table: list[Row]) -> str:
    """Whether saving memory pays: the best memory-saving candidate against the best plain."""
    plain = next((r for r in table if r.ev.strategy == "plain"), None)
    saving = next((r for r in table if r.ev.strategy != "plain"), None)
    if saving is None:
        return "memory saving: no memory-saving candidate fits"
    if plain is None:
        return "memory saving is needed: no plain schedule fits"
    gain = plain.ev.iteration_s / saving.ev.iteration_s
    verb = "pays" if gain > 1 else "does not pay"
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
        "baseline": cand(plan.baseline) if plan.baseline else None,
        "candidates": [
            cand(r.ev)
            | {
                "tokens_per_s": r.tokens_per_s,
                "mfu": r.mfu,
                "speedup": r.speedup,
                "mfu_bound": r.mfu_bound,
            }
            for r in rows(plan)
        ],
        "over_budget": [cand(e) for e in ev.over],
        "skipped": [
            {"family": s.family, "strategy": s.strategy, "mbs": s.mbs, "reason": s.reason}
            for s in ev.skipped
        ],
    }
