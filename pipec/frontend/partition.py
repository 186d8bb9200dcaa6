"""How many blocks each stage gets.

The blocks are those of every stack the forward runs, numbered across the stacks in execution
order (`pipec.frontend.blocks`). A partition is a list of block counts per stage (each ≥ 1);
`stages.split` cuts the graph accordingly.

Policies: `uniform` (equal block counts, the first `L mod S` stages one more), `balanced`
(contiguous blocks minimising the largest per-stage cost, embedding and head included, then the
spread of the others), an explicit list, or split points naming the blocks where stages begin.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from pipec.frontend.blocks import Stacks
from pipec.frontend.spec import FrontendError

PARTITION_MODES = ("uniform", "balanced")


def check_fits(stacks: Stacks, n_stages: int, v: int = 1) -> None:
    """Refuse more stages than blocks, naming the stacks, v and the largest p that fits."""
    n = stacks.n_blocks
    if 1 <= n_stages <= n:
        return
    if v == 1:
        fix = f"; use 1 to {n} stages"
    else:
        fix = (
            f": v={v} stages on each rank, so they fit at most p={n // v} (asked p={n_stages // v})"
        )
    raise FrontendError(
        f"cannot split {n} blocks into {n_stages} stages ({stacks.describe()}){fix}"
    )


def uniform(n_blocks: int, n_stages: int) -> list[int]:
    """Equal block counts; the first `n_blocks % n_stages` stages get one more."""
    q, r = divmod(n_blocks, n_stages)
    return [q + (1 if s < r else 0) for s in range(n_stages)]


def balanced(costs: list[int], n_stages: int) -> list[int]:
    """Block counts of the contiguous split of `costs` whose most expensive stage is cheapest.

    Among the splits reaching that optimum, the one with the smallest sum of squared stage
    costs, so stages other than the bottleneck are even too. Two exact dynamic programmes,
    O(S·L²) each; remaining ties go to the split found first (deterministic).
    """
    bottleneck = _split_dp(costs, n_stages, lambda prev, seg: max(prev, seg), float("inf"))[0]
    return _split_dp(costs, n_stages, lambda prev, seg: prev + seg * seg, bottleneck)[1]


def _split_dp(costs: list[int], n_stages: int, combine, cap: float) -> tuple[float, list[int]]:  # type: ignore[no-untyped-def]
    """Minimise `combine`-folded stage costs over contiguous splits with no stage above `cap`."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                segment = prefix[i] - prefix[j]
                if segment > cap or best[s - 1][j] == inf:
                    continue
                candidate = combine(best[s - 1][j], segment)
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    counts, i = [], n
    for s in range(n_stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return best[n_stages][n], counts[::-1]


def resolve(
    partition: str | list[int], block_costs: list[int], n_stages: int
) -> tuple[str, list[int]]:
    """(mode, block counts) for a partition argument: a mode name, "3,2,2,1", or a list."""
    n_blocks = len(block_costs)
    if not 1 <= n_stages <= n_blocks:
        raise FrontendError(f"cannot split {n_blocks} blocks into {n_stages} stages")
    if partition == "uniform":
        return "uniform", uniform(n_blocks, n_stages)
    if partition == "balanced":
        return "balanced", balanced(block_costs, n_stages)
    if isinstance(partition, str):
        try:
            counts = [int(c) for c in partition.split(",")]
        except ValueError:
            raise FrontendError(
                f"partition {partition!r} is not one of {', '.join(PARTITION_MODES)} "
                "or a comma-separated list of block counts such as 3,2,2,1"
            ) from None
    else:
        counts = list(partition)
    if len(counts) != n_stages or sum(counts) != n_blocks or min(counts) < 1:
        raise FrontendError(
            f"partition {counts} must have {n_stages} block counts, each at least 1, summing to "
            f"{n_blocks} (the model's blocks)"
        )
    return "explicit", counts


def split_point_counts(points: Sequence[str], stacks: Stacks, n_stages: int) -> list[int]:
    """Block counts per stage for split points naming the blocks where stages 1, 2, … begin.

    A point is a block's qualified name (`model.layers.4`, `decoder.block.0`) or a dotted suffix
    of it (`layers.4`), in any of the stacks. Raises `FrontendError` for a point that names no
    block, points out of order, a point at block 0 (stage 0 would be empty), or a count that
    does not make `n_stages`.
    """
    names = stacks.names()
    n_blocks = len(names)
    starts = []
    for point in points:
        hits = [i for i, name in enumerate(names) if name == point or name.endswith("." + point)]
        if len(hits) != 1:
            raise FrontendError(
                f"split point {point!r} names no block of {stacks.path or 'the model'}; "
                f"use one of {stacks.describe()}"
            )
        starts.append(hits[0])
    bounds = [0, *starts, n_blocks]
    for k, (a, b) in enumerate(pairwise(bounds)):
        if a >= b:
            where = f"after {points[k - 1]!r}" if k else "at the first block"
            raise FrontendError(
                f"split point {points[k]!r} comes {where}: split points must name blocks in "
                f"increasing order, after {names[0]}"
            )
    if len(points) + 1 != n_stages:
        raise FrontendError(
            f"{len(points)} split points make {len(points) + 1} stages, but the schedule has "
            f"{n_stages} (p·v); give {n_stages - 1} split points"
        )
    return [b - a for a, b in pairwise(bounds)]
