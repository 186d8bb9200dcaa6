"""The text tables `compile`, `simulate` and `show` print: per-rank figures, the placement and
what eviction did."""

from __future__ import annotations

from pipec.build_dir import time_unit
from pipec.ir import Layout
from pipec.passes.costs import CostModel
from pipec.passes.evict import amount
from pipec.passes.simulate import SimResult
from pipec.passes.topology import Topology


def eviction(sim: SimResult, layout: Layout, costs: CostModel, plan: dict) -> dict:
    """What eviction did in one iteration, for printing and for --json; with a model, the
    limit and the moved stashes also in bytes (each stash weighs its stage's stash bytes)."""
    g = costs.topology.gpus_per_node if costs.topology else None
    inter = sum(t.size for t in sim.transfers if g and t.src // g != t.dst // g)
    out = {
        "memory_limit": plan["memory_limit"],
        "evicted": sum(t.kind == "evict" for t in sim.transfers),
        "moved_stashes": round(sim.moved, 9),
        "moved_inter_node": round(inter, 9),
    }
    if costs.stash_bytes:
        chunk, share = layout.stage_chunk, layout.stash_share
        per_unit = [b / costs.mem_F / share for b in costs.stash_bytes]
        out["moved_bytes"] = round(sum(t.size * per_unit[chunk[t.stage]] for t in sim.transfers))
        out["peak_stash_bytes"] = max(r.peak_stash_bytes for r in sim.ranks)
        if "memory_limit_bytes" in plan:
            out["memory_limit_bytes"] = plan["memory_limit_bytes"]
    return out


def eviction_line(sim: SimResult, layout: Layout, costs: CostModel, plan: dict) -> str:
    figures = eviction(sim, layout, costs, plan)
    stash = f"{plan['precision']} stash" if "precision" in plan else "stash"  # as priced
    if "memory_limit_bytes" in figures:
        limit = f"{amount(figures['memory_limit_bytes'], True)} of {stash}"
    else:
        limit = f"{figures['memory_limit']:g} stashes"
    moved = f"{figures['moved_stashes']:g} stash units"
    peak = ""
    if "moved_bytes" in figures:
        moved += f" ({figures['moved_bytes']}B)"
        peak = f"; peak {amount(figures['peak_stash_bytes'], True)} of {stash} on a rank"
    return (
        f"evict: limit {limit} per rank; {figures['evicted']} stashes evicted and loaded back, "
        f"{moved} moved per iteration ({figures['moved_inter_node']:g} over inter-node "
        f"links){peak}"
    )


def placement_table(layout: Layout, topology: Topology | None) -> str:
    g = topology.gpus_per_node if topology else layout.p
    lines = [f"{'stage':>5}  {'rank':>4}  {'node':>4}  {'gpu':>3}"]
    for s, r in enumerate(layout.stage_rank):
        node, gpu = divmod(r, g)
        lines.append(f"{s:>5}  {r:>4}  {node:>4}  {gpu:>3}")
    return "\n".join(lines)


def rank_table(sim: SimResult, plan: dict) -> str:
    """Per-rank figures, then makespan and bubbles, times in the plan's unit (named when it
    has one) and a note when they come from estimated costs."""
    unit, note = time_unit(plan)
    head = f"{'rank':>4}  {'busy':>10}  {'span':>10}  {'peak act':>9}  {'params':>6}  {'sync':>6}"
    if unit:
        head += f"  (times in {unit})"
    lines = [head]
    for r, s in enumerate(sim.ranks):
        lines.append(
            f"{r:>4}  {s.busy:>10.4g}  {s.span:>10.4g}  {s.peak_activations:>9.4g}  "
            f"{s.params:>6.4g}  {s.sync:>6.4g}"
        )
    lines.append(
        f"makespan {sim.makespan:.6g}{' ' + unit if unit else ''}  bubble {sim.bubble:.4f}  "
        f"span_bubble {sim.span_bubble:.4f}"
    )
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)
