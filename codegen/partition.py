"""The partition as a user reads it: which stacks of blocks, which blocks each stage holds, and
each stage's share of the model's counted F+B+W FLOPs.

`partition_text(model)` prints it from a build's model plan (`plan.json["model"]`), so that
`pipec compile` and `pipec show` say the same; `block_names`, `span` and `describe` name blocks
across stacks for the frontend's messages too. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby, pairwise

from pipec.ir import Layout

Stack = tuple[str, int]  # (path of the ModuleList/Sequential, its blocks)

#: Above this many stages the partition is one line of block counts, not a line per stage.
MAX_STAGE_LINES = 16


def block_names(stacks: Sequence[Stack]) -> list[str]:
    """Qualified names of all blocks in order (`encoder.block.0`, …, `decoder.block.3`); the
    blocks of a model that is itself the stack are `0`, `1`, …"""
    return [f"{path}.{i}" if path else str(i) for path, n in stacks for i in range(n)]


def span(stacks: Sequence[Stack], first: int, stop: int) -> str:
    """Blocks [first, stop) as a range per stack: `encoder.block.2-3 decoder.block.0`."""
    parts = []
    names = block_names(stacks)[first:stop]
    for prefix, group in groupby(names, key=lambda name: name.rpartition(".")[0]):
        idx = [name.rpartition(".")[2] for name in group]
        dotted = f"{prefix}." if prefix else ""
        parts.append(f"{dotted}{idx[0]}" + (f"-{idx[-1]}" if len(idx) > 1 else ""))
    return " ".join(parts)


def describe(stacks: Sequence[Stack]) -> str:
    """Every stack with its block range: `encoder.block.0-3, decoder.block.0-3`."""
    starts = [0]
    for _, n in stacks:
        starts.append(starts[-1] + n)
    return ", ".join(span(stacks, a, b) for a, b in pairwise(starts))


def plan_stacks(model: dict) -> list[Stack]:
    """The stacks a model plan was cut along (one stack when the plan names one)."""
    blocks = model["blocks"]
    return [(s["path"], s["count"]) for s in blocks.get("stacks", [blocks])]


def partition_text(model: dict, layout: Layout) -> str:
    """Blocks found and how they were split, a line per stage with the rank(s) `layout` puts
    it on (one line past `MAX_STAGE_LINES` stages):

        blocks: encoder.block.0-3, decoder.block.0-3 (8), balanced, 4 stages
          stage 0 (rank 0): encoder.block.0-1   22.0% of F+B+W FLOPs
          ...
          tied: shared.weight (stage 0) = lm_head.weight (stage 3): one parameter, ...
    """
    stacks = plan_stacks(model)
    n_blocks = sum(n for _, n in stacks)
    stages = model["stages"]
    mode = model["partition"]["mode"]
    head = f"blocks: {describe(stacks)} ({n_blocks}), {mode}, {len(stages)} stages"
    totals = [sum(s["flops"].values()) for s in stages]
    whole = sum(totals) or 1
    shares = [100 * t / whole for t in totals]
    tied = [
        "  tied: "
        + " = ".join(f"{h['name']} (stage {h['stage']})" for h in group)
        + ": one parameter, its gradients summed each step"
        for group in model.get("tied_parameters", [])
    ]
    if len(stages) > MAX_STAGE_LINES:
        counts = ",".join(str(n) for n in model["partition"]["blocks_per_stage"])
        summary = (
            f"  blocks per stage {counts}; F+B+W FLOPs per stage "
            f"{min(shares):.1f}% to {max(shares):.1f}% of the model's"
        )
        return "\n".join([head, summary, *tied])
    ranks: dict[int, list[int]] = {}
    for stage, chunk in enumerate(layout.stage_chunk):
        ranks.setdefault(chunk, []).append(layout.stage_rank[stage])
    held = [
        f"stage {k:>{len(str(len(stages) - 1))}} (rank{'s' if len(ranks[k]) > 1 else ''} "
        f"{','.join(map(str, ranks[k]))})"
        for k in range(len(stages))
    ]
    spans = [span(stacks, *s["blocks"]) for s in stages]
    width = max(len(s) for s in spans)
    lines = [
        f"  {who}: {where:<{width}}  {share:5.1f}%" + (" of F+B+W FLOPs" if k == 0 else "")
        for k, (who, where, share) in enumerate(zip(held, spans, shares))
    ]
    return "\n".join([head, *lines, *tied])
