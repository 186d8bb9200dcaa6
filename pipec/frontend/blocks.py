"""Where a model's repeated blocks are: every stack of them the forward runs, in order.

A *stack* is an `nn.ModuleList` (`model.layers`, T5's `encoder.block` and `decoder.block`) or
an `nn.Sequential` of repeated blocks: all its children of one type (a ResNet's `layer1..4`), or
a run of two or more composite modules of one type between other layers
(`Sequential(Linear, Block, Block, Block, Linear)`: every child is a block). A stack inside a
block of another stack (a mixture's `experts`) is part of that block. A container of distinct
layers (a ResNet's `stem` of conv, BN, ReLU) is not a stack.

A stack whose every block holds a stack of its own as a direct child (Swin's and ConvNeXt's
stages of layers, a U-Net's levels of convolutions) can also be cut one level down:
`refine(model, stacks)` lists the inner stacks in its place, so that a stage boundary may fall
inside an outer block when its blocks differ much in cost (what the outer block does besides
its inner stack, a downsampling, goes with the inner block before it).

`find_blocks(model)` lists the stacks from the module tree alone (cheap: the block count before
any capture); `locate(gm, stacks)` keeps those the captured forward runs, in execution order
(of two stacks whose calls interleave, as in `zip(self.attns, self.mlps)`, the longer), and
numbers the blocks across them: stage partitions and split points range over all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import groupby

from torch import fx, nn

from pipec.codegen.partition import block_names, describe
from pipec.frontend.spec import FrontendError


@dataclass(frozen=True)
class Stacks:
    """Stacks of blocks in execution order, as (path, block count); block `k` of the model is
    counted across them (the model's own path is "" when it is itself the stack)."""

    stacks: tuple[tuple[str, int], ...]

    @property
    def n_blocks(self) -> int:
        return sum(n for _, n in self.stacks)

    @property
    def path(self) -> str:
        """The stacks' paths, comma-separated (the plan's `blocks.path`)."""
        return ", ".join(path for path, _ in self.stacks)

    def names(self) -> list[str]:
        """Qualified names of all blocks, in order (`encoder.block.0`, …, `decoder.block.5`)."""
        return block_names(self.stacks)

    def describe(self) -> str:
        """Each stack with its block range: `encoder.block.0-5, decoder.block.0-5`."""
        return describe(self.stacks)

    def pattern(self) -> re.Pattern[str]:
        """Matches a qualified name inside a block: the stack's path (group 1), index (2)."""
        alts = "|".join(re.escape(path) + r"\." if path else "" for path, _ in self.stacks)
        return re.compile(rf"^({alts})(\d+)(\.|$)")

    def index(self, match: re.Match[str]) -> int:
        """The model-wide block index of a `pattern()` match."""
        path, local = match.group(1).removesuffix("."), int(match.group(2))
        offset = 0
        for p, n in self.stacks:
            if p == path:
                return offset + local
            offset += n
        raise KeyError(path)


def find_blocks(model: nn.Module) -> Stacks:
    """The model's stacks in module order (see the module docstring), before any capture.

    Raises FrontendError naming the containers found when none is a stack of repeated blocks.
    """
    found: list[tuple[str, int]] = []
    containers = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) == 0:
            continue
        containers.append((name, m))
        inside = any(not path or name.startswith(path + ".") for path, _ in found)
        if not inside and _repeated(m):
            found.append((name, len(m)))
    if found:
        return Stacks(tuple(found))
    what = type(model).__name__
    if not containers:
        raise FrontendError(
            f"{what} has no nn.ModuleList or nn.Sequential of blocks; pipec splits a model "
            "between the blocks of one (e.g. self.blocks = nn.ModuleList(...))"
        )
    seen = "; ".join(
        f"{name or 'the model'}: {type(m).__name__} of "
        + ", ".join(dict.fromkeys(type(c).__name__ for c in m.children()))
        for name, m in containers[:3]
    )
    raise FrontendError(
        f"{what} has no repeated blocks to split between (found {seen}); pipec cuts between "
        "blocks of one type held in an nn.ModuleList or nn.Sequential "
        "(e.g. self.blocks = nn.ModuleList(Block() for _ in range(n)))"
    )


def refine(model: nn.Module, stacks: Stacks) -> Stacks | None:
    """`stacks` one level down where every block of a stack holds exactly one stack as a direct
    child: those inner stacks in its place, in order; None when no stack refines."""
    out: list[tuple[str, int]] = []
    for path, n in stacks.stacks:
        inner = [_inner_stack(model, f"{path}.{i}" if path else str(i)) for i in range(n)]
        out += [s for s in inner if s is not None] if all(inner) else [(path, n)]
    return Stacks(tuple(out)) if tuple(out) != stacks.stacks else None


def _inner_stack(model: nn.Module, block: str) -> tuple[str, int] | None:
    found = [
        (f"{block}.{name}", len(m))
        for name, m in model.get_submodule(block).named_children()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0 and _repeated(m)
    ]
    return found[0] if len(found) == 1 else None


def _repeated(m: nn.Module) -> bool:
    """A ModuleList holds blocks (of one type or several, as a hybrid model's layers); a
    Sequential holds blocks when its children are of one type (two or more, or one composite
    module), or when it runs two or more composite modules of one type in a row."""
    children = list(m.children())
    if isinstance(m, nn.ModuleList) or (
        len({type(c) for c in children}) == 1 and (len(children) > 1 or _composite(children[0]))
    ):
        return True
    for _, run in groupby(children, key=type):
        first, *rest = run
        if rest and _composite(first):
            return True
    return False


def _composite(m: nn.Module) -> bool:
    return any(True for _ in m.children())


def locate(gm: fx.GraphModule, stacks: Stacks) -> tuple[Stacks, dict[fx.Node, int]]:
    """The stacks the captured forward runs, in execution order, and every node's block.

    Nodes outside the blocks go with the block before them (the first block when they come
    first): an embedding lands with the first block, a final norm and head with the last, and
    what runs between two stacks (an encoder's final norm) with the last block of the first.
    Raises FrontendError when a block holding parameters never runs.
    """
    pattern = stacks.pattern()
    spans: dict[str, list[int]] = {}  # path -> [first node, last node]
    for position, node in enumerate(gm.graph.nodes):
        match = _match(node, pattern)
        if match:
            path = match.group(1).removesuffix(".")
            spans.setdefault(path, [position, position])[1] = position
    if not spans:
        raise FrontendError(
            f"none of the blocks of {stacks.path or 'the model'} ran in forward; pipec needs "
            "every block called once, in order"
        )
    counts = dict(stacks.stacks)
    order = list(counts)
    kept: list[str] = []
    for path in sorted(spans, key=lambda p: spans[p][0]):
        if kept and spans[path][0] < spans[kept[-1]][1]:  # calls interleave: keep the longer
            if counts[path] > counts[kept[-1]] or (
                counts[path] == counts[kept[-1]] and order.index(path) < order.index(kept[-1])
            ):
                kept[-1] = path
            continue
        kept.append(path)
    ran = Stacks(tuple((path, counts[path]) for path in kept))
    return ran, _block_of_nodes(gm, ran)


def _match(node: fx.Node, pattern: re.Pattern[str]) -> re.Match[str] | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = pattern.match(path)
        if match:
            return match
    return None


def _block_of_nodes(gm: fx.GraphModule, stacks: Stacks) -> dict[fx.Node, int]:
    pattern = stacks.pattern()
    result: dict[fx.Node, int] = {}
    current = 0
    seen = set()
    for node in gm.graph.nodes:
        match = _match(node, pattern)
        if match:
            current = stacks.index(match)
            seen.add(current)
        result[node] = current
    # A block without parameters may leave no node (an nn.Identity under torch.export).
    names = stacks.names()
    missing = [
        i for i in range(stacks.n_blocks) if i not in seen and _holds_parameters(gm, names[i])
    ]
    if missing:
        raise FrontendError(
            f"{len(missing)} of the {stacks.n_blocks} blocks of {stacks.path or 'the model'} "
            f"never ran in forward (first: {names[missing[0]]}); pipec needs every block "
            "called once, in order"
        )
    return result


def _holds_parameters(gm: fx.GraphModule, name: str) -> bool:
    try:
        block = gm.get_submodule(name)
    except AttributeError:  # an exported module keeps only the modules holding tensors
        return False
    return any(True for _ in block.parameters())
