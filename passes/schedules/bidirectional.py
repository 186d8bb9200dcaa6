"""The layout shared by bidirectional schedules (Chimera, BitPipe, DualPipe).

Two replicas of the model run as two pipelines in opposite directions over the same ranks.
The down pipeline places position k (model chunk k) on `down[k]`; the up pipeline is its mirror,
position k on rank p-1-down[k]. Stages 0..n-1 are the down pipeline's positions, stages
n..2n-1 the up pipeline's, and stage n+k computes the same chunk k as stage k: the two replicas
whose gradients are all-reduced. Micro-batches split half and half: the first half flows down.
"""

from __future__ import annotations

from pipec.ir import Layout, Pipeline
from pipec.passes.registry import Request


def two_way_layout(p: int, m: int, down: tuple[int, ...]) -> Layout:
    """Down pipeline over ranks `down` (one per position), up pipeline over its mirror."""
    n = len(down)
    half = m // 2
    return Layout(
        p,
        stage_rank=down + tuple(p - 1 - r for r in down),
        stage_chunk=tuple(range(n)) * 2,
        pipelines=(
            Pipeline(tuple(range(n)), tuple(range(half))),
            Pipeline(tuple(range(n, 2 * n)), tuple(range(half, m))),
        ),
    )


def even_p(req: Request) -> str | None:
    """Rank r pairs with rank p-1-r; with odd p the middle rank would hold both replicas."""
    if req.p % 2:
        return (
            f"--pp {req.p} must be even: the two pipelines pair rank r with rank p-1-r, "
            f"so odd p puts both replicas of a chunk on the middle rank; try {req.p + 1}"
        )
    return None
