"""Cut a captured model's graph into a chain of stage graph modules.

Each node gets a *home* stage: placeholders stage 0, every other node the stage of its block
(`blocks.locate`), an `operator.getitem` of a non-tensor value its source's stage.
Then, for every stage:

- Values that need no input (derived only from constants, buffers and shapes: a position
  range, a causal mask, rotary tables) are *recomputed* in each stage that uses them instead of
  crossing a cut; parameters and buffers (`get_attr`) are read by each stage that uses them.
- Every other value a later stage uses crosses each cut in between: a stage's outputs are the
  values live across the cut after it, in the captured graph's order, so a value used by a
  non-adjacent stage (an attention mask, an input of the model) is forwarded by the stages in
  between. Stage k+1's inputs are exactly stage k's outputs, in order.
- The last stage returns the model's output as the model does: the fx output structure, or
  the exported output's pytree (a `ModelOutput`, a dict, a tuple).

Stage modules keep the model's qualified names (`blocks.3.attn.qkv.weight`) and share the
model's parameters; `keep_persistence` and `name_as_the_model` make a stage's state_dict hold
what the model's holds, under the model's names.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Collection

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from pipec.frontend.spec import FrontendError


def positional(info: fx.graph._PyTreeInfo, names: list[str]) -> fx.graph._PyTreeInfo:
    """An exported graph's pytree calling convention, taking `names` positionally and nothing
    else: how a stage (or a model whose keyword arguments were folded) is called."""
    return info._replace(orig_args=names, in_spec=pytree.tree_structure((tuple(names), {})))


def split(
    gm: fx.GraphModule, block_of: dict[fx.Node, int], counts: list[int]
) -> list[fx.GraphModule]:
    """Stage graph modules in order (see the module docstring); `counts` are blocks per stage."""
    stage_of_block = [s for s, c in enumerate(counts) for _ in range(c)]
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    free = _free_nodes(gm)
    home = _homes(nodes, block_of, stage_of_block)
    n_stages = len(counts)
    # last[v]: the last stage that reads v; values read after their home stage cross cuts.
    last: dict[fx.Node, int] = {}
    for node in nodes:
        user_stage = n_stages - 1 if node is output else home.get(node)
        for arg in node.all_input_nodes:
            if arg in free or arg.op == "get_attr" or user_stage is None:
                continue
            if home[arg] > user_stage:
                raise FrontendError(
                    f"'{arg.name}' is computed in stage {home[arg]} but used in stage "
                    f"{user_stage}: the blocks of {type(gm).__name__} must run in order"
                )
            last[arg] = max(last.get(arg, -1), user_stage)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = [n for n in nodes if n.op == "placeholder"]
    stages = []
    for k in range(n_stages):
        live_out = [v for v in nodes if v in last and home[v] <= k < last[v]]
        stages.append(_stage(gm, k, nodes, home, free, inputs, live_out, order, k == n_stages - 1))
        inputs = live_out
    return stages


def _free_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on no input and no parameter: recomputable in any stage."""
    params = {id(p) for p in gm.parameters()}
    free: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            recomputable = id(_attr(gm, str(node.target))) not in params
        else:
            recomputable = (
                node.op == "call_function"
                and _pure(node.target)
                and all(a in free for a in node.all_input_nodes)
            )
        if recomputable:
            free.add(node)
    return free


def _pure(target: object) -> bool:
    """Whether a call gives the same value wherever it runs: no mutation, no randomness."""
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    return target in (operator.getitem, torch.arange, torch.ones, torch.zeros, torch.full)


def _homes(
    nodes: list[fx.Node], block_of: dict[fx.Node, int], stage_of_block: list[int]
) -> dict[fx.Node, int]:
    """The stage that computes each node (free nodes and `get_attr`s are also copied into each
    stage that reads them)."""
    home: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "placeholder":
            home[node] = 0
        elif node.op == "output":
            continue
        elif node.target is operator.getitem and not _is_tensor(node.args[0]):
            home[node] = home[node.args[0]]  # type: ignore[index]
        else:
            home[node] = stage_of_block[block_of[node]]
    return home


def _is_tensor(node: object) -> bool:
    """Whether a node's value is a tensor (from export's fake value; fx nodes are assumed so)."""
    if not isinstance(node, fx.Node):
        return False
    val = node.meta.get("val", node.meta.get("example_value"))
    return val is None or isinstance(val, Tensor)


def _stage(
    gm: fx.GraphModule,
    k: int,
    nodes: list[fx.Node],
    home: dict[fx.Node, int],
    free: set[fx.Node],
    inputs: list[fx.Node],
    live_out: list[fx.Node],
    order: dict[fx.Node, int],
    last: bool,
) -> fx.GraphModule:
    """Stage k's graph module: placeholders `inputs`; the nodes it computes, with the free
    nodes and `get_attr`s they read; outputs `live_out` (or the model's output if `last`)."""
    output = nodes[-1]
    mine = [
        n
        for n in nodes
        if home.get(n) == k and n.op not in ("placeholder", "get_attr") and n not in free
    ]
    readers = mine + [output] if last else mine
    needed: set[fx.Node] = set()
    frontier = [a for n in readers for a in n.all_input_nodes if a in free or a.op == "get_attr"]
    while frontier:
        node = frontier.pop()
        if node not in needed:
            needed.add(node)
            frontier.extend(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = node.meta
    for node in sorted(needed.union(mine), key=order.__getitem__):
        env[node] = graph.node_copy(node, env.__getitem__)
    if last:
        graph.output(fx.map_arg(output.args[0], env.__getitem__))
        codegen = gm.graph._codegen
        if isinstance(codegen, fx.graph._PyTreeCodeGen):
            names = [n.name for n in graph.nodes if n.op == "placeholder"]
            info = positional(codegen.pytree_info, names)
            graph._codegen = fx.graph._PyTreeCodeGen(copy.copy(info))
    else:
        values = [env[v] for v in live_out]
        graph.output(values[0] if len(values) == 1 else tuple(values))
    graph.lint()
    return fx.GraphModule(gm, graph, f"Stage{k}")


def _attr(gm: fx.GraphModule, target: str) -> object:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def keep_persistence(stage: nn.Module, persistent: Collection[str]) -> None:
    """Make the buffers of `stage` that the model's state_dict (`persistent`, its names) leaves
    out non-persistent again. fx.GraphModule registers every buffer it copies as persistent, so
    a stage would save what the model does not (the rotary tables of Hugging Face decoders,
    held by every stage that computes them), and a checkpoint would hold it once per stage."""
    for name, _ in stage.named_buffers(remove_duplicate=False):
        if name not in persistent:
            owner, _, leaf = name.rpartition(".")
            stage.get_submodule(owner)._non_persistent_buffers_set.add(leaf)


def name_as_the_model(stage: nn.Module, names: dict[int, list[str]], held: Collection[str]) -> None:
    """Register on `stage` each name the model saves one of its tensors under (`names`: the
    model's saved names by tensor id) that no stage holds (`held`: the names the stages hold).

    A graph reads a tensor the model names twice under one name only (BERT's head bias is also
    its decoder's, T5's shared embedding its encoder's and decoder's), so no stage would hold
    the others: a checkpoint would lack them, and neither load into the plain model nor export
    as it. With them, the stages' state_dicts together hold every entry of the model's (a
    checkpoint writes each tensor once, the other names as aliases).
    """
    for tensor in list(stage.state_dict(keep_vars=True).values()):
        for name in names.get(id(tensor), ()):
            if name not in held:
                owner, _, leaf = name.rpartition(".")
                module = stage
                for part in owner.split(".") if owner else ():
                    if part not in module._modules:
                        module.add_module(part, nn.Module())
                    module = module._modules[part]
                if isinstance(tensor, nn.Parameter):
                    module.register_parameter(leaf, tensor)
                else:
                    module.register_buffer(leaf, tensor)
