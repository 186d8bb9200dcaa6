"""Split a traced decoder into pipeline stages at block boundaries.

The *blocks* are the children of the model's longest `nn.ModuleList` (`model.blocks`,
`model.layers`, …). Every node belongs to one block (through `meta["nn_module_stack"]`); nodes
outside the blocks go with the block before them, or with block 0 when they come first, so the
embedding lands on the first stage and the final norm and head on the last. A partition is a
list of block counts per stage (each ≥ 1); the policy `node -> stage` is handed to
`torch.fx.passes.split_module.split_module(..., keep_original_order=True)`.

Policies: `uniform` (equal block counts, the first `L mod S` stages one more), `balanced`
(contiguous blocks minimising the largest per-stage cost, embedding and head included, then the
spread of the others), or an explicit list.
"""

from __future__ import annotations

import operator
import re

from torch import fx, nn
from torch.fx.passes.split_module import split_module

from pipec.frontend.spec import FrontendError

PARTITION_MODES = ("uniform", "balanced")


def find_blocks(model: nn.Module) -> tuple[str, int]:
    """Path and length of the model's longest `nn.ModuleList`: its repeated blocks."""
    lists = [(len(m), name) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    lists = [(n, name) for n, name in lists if n > 0]
    if not lists:
        raise FrontendError(
            f"{type(model).__name__} has no nn.ModuleList of blocks; pipec splits a model between "
            "the blocks of a ModuleList (e.g. self.blocks = nn.ModuleList(...))"
        )
    n, name = max(lists, key=lambda t: t[0])  # max keeps the first of equals: deterministic
    return name, n


def block_of_nodes(gm: fx.GraphModule, blocks: str, n_blocks: int) -> dict[fx.Node, int]:
    """The block index of every node (see the module docstring for nodes outside blocks)."""
    pattern = re.compile(rf"^{re.escape(blocks)}\.(\d+)(\.|$)")
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
    if len(seen) != n_blocks:
        missing = sorted(set(range(n_blocks)) - seen)
        raise FrontendError(
            f"blocks {blocks}.{missing} never ran in forward; pipec needs every block of "
            f"{blocks} called once, in order"
        )
    return result


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


def split(
    gm: fx.GraphModule, model: nn.Module, block_of: dict[fx.Node, int], counts: list[int]
) -> list[fx.GraphModule]:
    """Stage graph modules in order, chained: stage k's outputs are stage k+1's inputs, in order.

    Stage modules keep the model's parameter names (`blocks.3.attn.qkv.weight`) and share the
    model's parameters. Parameters and buffers read directly (`get_attr`) move into each stage
    that reads them. Raises `FrontendError` when a value skips a stage (only neighbouring stages
    can exchange tensors) or when the model output does not come from the last stage.
    """
    stage_of_block = [s for s, c in enumerate(counts) for _ in range(c)]
    qualnames: dict[str, str] = {}
    root = split_module(
        gm,
        model,
        lambda node: stage_of_block[block_of[node]],
        qualname_map=qualnames,
        keep_original_order=True,
    )
    calls = [n for n in root.graph.nodes if n.op == "call_module"]
    assert [c.target for c in calls] == [f"submod_{k}" for k in range(len(counts))], calls
    inputs = [n for n in root.graph.nodes if n.op == "placeholder"]
    stages = []
    for k, call in enumerate(calls):
        graph = _copy_graph(getattr(root, str(call.target)).graph, f"{call.target}.", qualnames)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        order = {}
        for ph, arg in zip(placeholders, call.args, strict=True):
            if arg.op == "get_attr":
                _inline_get_attr(graph, ph, str(arg.target))
            else:
                order[ph] = _source_index(root, arg, k, calls, inputs, model)
        if k == 0 and sorted(order.values()) != list(range(len(inputs))):
            raise FrontendError(
                f"every input of {type(model).__name__}.forward must be used by the first stage"
            )
        anchor = next(n for n in graph.nodes if n.op != "placeholder")
        for ph in sorted(order, key=order.__getitem__):
            anchor.prepend(ph)
        graph.lint()
        stages.append(fx.GraphModule(model, graph, f"Stage{k}"))
    output = next(n for n in root.graph.nodes if n.op == "output")
    if output.args[0] is not calls[-1]:
        raise FrontendError(
            f"{type(model).__name__}.forward must return one tensor computed by its last block "
            "or after it (pipec applies loss_fn to it on the last stage)"
        )
    return stages


def _copy_graph(graph: fx.Graph, prefix: str, qualnames: dict[str, str]) -> fx.Graph:
    """A copy of a split_module partition whose module targets are the model's qualified names."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    for node in new.nodes:
        if node.op in ("call_module", "get_attr"):
            node.target = qualnames.get(prefix + str(node.target), node.target)
    return new


def _inline_get_attr(graph: fx.Graph, placeholder: fx.Node, target: str) -> None:
    """Replace a placeholder fed by the root's `get_attr` with a `get_attr` in the stage itself."""
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(anchor):
        attr = graph.get_attr(target)
    attr.meta = placeholder.meta
    placeholder.replace_all_uses_with(attr)
    graph.erase_node(placeholder)


def _source_index(
    root: fx.GraphModule,
    arg: fx.Node,
    k: int,
    calls: list[fx.Node],
    inputs: list[fx.Node],
    model: nn.Module,
) -> int:
    """Position of `arg` in what stage k receives: the model inputs (k = 0) or stage k-1's
    outputs."""
    if k == 0:
        if arg in inputs:
            return inputs.index(arg)
        raise AssertionError(f"stage 0 input {arg} is neither a model input nor a parameter")
    if arg is calls[k - 1]:
        return 0
    if arg.op == "call_function" and arg.target is operator.getitem and arg.args[0] is calls[k - 1]:
        return int(arg.args[1])  # type: ignore[arg-type]
    if arg in inputs:
        source = f"model input '{arg.name}'"
    else:
        producer, index = (arg.args[0], arg.args[1]) if arg.op == "call_function" else (arg, 0)
        values = next(n for n in getattr(root, producer.target).graph.nodes if n.op == "output")
        value = values.args[0][index] if isinstance(values.args[0], tuple) else values.args[0]
        source = f"value '{value}' of stage {calls.index(producer)}"
    raise FrontendError(
        f"{source} is used by stage {k} of {type(model).__name__}; stages only pass tensors to "
        "the next stage, so compute it inside each block or carry it in the residual stream"
    )
