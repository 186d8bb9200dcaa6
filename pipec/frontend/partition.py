"""Which block each node of a captured model belongs to, and how many blocks each stage gets.

The *blocks* are the children of the model's longest `nn.ModuleList` (`model.blocks`,
`model.layers`, `encoder.layers` of `nn.TransformerEncoder`, …), or of its longest
`nn.Sequential` when it has no ModuleList. Every node belongs to one block (through
`meta["nn_module_stack"]`); nodes outside the blocks go with the block before them, or with
block 0 when they come first, so the embedding lands on the first stage and the final norm and
head on the last. A partition is a list of block counts per stage (each ≥ 1); `stages.split`
cuts the graph accordingly.

Policies: `uniform` (equal block counts, the first `L mod S` stages one more), `balanced`
(contiguous blocks minimising the largest per-stage cost, embedding and head included, then the
spread of the others), an explicit list, or split points naming the blocks where stages begin.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import pairwise

from torch import fx, nn

from pipec.frontend.spec import FrontendError

PARTITION_MODES = ("uniform", "balanced")


def find_blocks(model: nn.Module) -> tuple[str, int]:
    """Path and length of the model's longest `nn.ModuleList` (else `nn.Sequential`): its
    repeated blocks. The path of a model that is itself a Sequential is ""."""
    for kind in (nn.ModuleList, nn.Sequential):
        lists = [(len(m), name) for name, m in model.named_modules() if isinstance(m, kind)]
        lists = [(n, name) for n, name in lists if n > 0]
        if lists:
            n, name = max(lists, key=lambda t: t[0])  # max keeps the first of equals
            return name, n
    raise FrontendError(
        f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks; pipec splits a "
        "model between the blocks of one (e.g. self.blocks = nn.ModuleList(...))"
    )


def block_name(blocks: str, index: int) -> str:
    """Qualified name of block `index` of the container at `blocks`."""
    return f"{blocks}.{index}" if blocks else str(index)


def block_of_nodes(gm: fx.GraphModule, blocks: str, n_blocks: int) -> dict[fx.Node, int]:
    """The block index of every node (see the module docstring for nodes outside blocks)."""
    prefix = re.escape(blocks) + r"\." if blocks else ""
    pattern = re.compile(rf"^{prefix}(\d+)(\.|$)")
    result: dict[fx.Node, int] = {}
    current = 0
    seen = set()
    for node in gm.graph.nodes:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            match = pattern.match(path)
            if match:
                current = int(match.group(1))
                seen.add(current)
                break
        result[node] = current
    # A block without parameters may leave no node (an nn.Identity under torch.export).
    missing = [i for i in range(n_blocks) if i not in seen and _holds_parameters(gm, blocks, i)]
    if missing:
        raise FrontendError(
            f"{len(missing)} of the {n_blocks} blocks of {blocks or 'the model'} never ran in "
            f"forward (first: {block_name(blocks, missing[0])}); pipec needs every block "
            "called once, in order"
        )
    return result


def _holds_parameters(gm: fx.GraphModule, blocks: str, index: int) -> bool:
    try:
        block = gm.get_submodule(block_name(blocks, index))
    except AttributeError:  # an exported module keeps only the modules holding tensors
        return False
    return any(True for _ in block.parameters())


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
        raise FrontendError(
            f"cannot split {n_blocks} blocks into {n_stages} stages; use 1 to {n_blocks} stages"
        )
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


def split_point_counts(
    points: Sequence[str], blocks: str, n_blocks: int, n_stages: int
) -> list[int]:
    """Block counts per stage for split points naming the blocks where stages 1, 2, … begin.

    A point is a block's qualified name (`model.layers.4`) or a dotted suffix of it
    (`layers.4`). Raises `FrontendError` for a point that names no block, points out of order,
    a point at block 0 (stage 0 would be empty), or a count that does not make `n_stages`.
    """
    names = [block_name(blocks, i) for i in range(n_blocks)]
    starts = []
    for point in points:
        hits = [i for i, name in enumerate(names) if name == point or name.endswith("." + point)]
        if len(hits) != 1:
            raise FrontendError(
                f"split point {point!r} names no block of {blocks or 'the model'}; "
                f"use one of {names[0]} to {names[-1]}"
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
