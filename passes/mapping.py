"""Stage-to-rank mappings, `(stage, n_stages, p) -> rank`, and rank-to-device placements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from pipec.ir import Layout, PipecError, Schedule
from pipec.passes.topology import Topology

Mapping = Callable[[int, int, int], int]


def sequential(stage: int, n_stages: int, p: int) -> int:
    """Consecutive stages on consecutive ranks, n_stages/p of them per rank."""
    return stage * p // n_stages


def interleaved(stage: int, n_stages: int, p: int) -> int:
    """Megatron's interleaving: stage s on rank s mod p, so each rank holds v strided chunks."""
    return stage % p


def v_shape(stage: int, n_stages: int, p: int) -> int:
    """The V placement over 2p stages: rank r holds stages r and 2p-1-r."""
    return stage if stage < p else n_stages - 1 - stage


def stage_ranks(mapping: Mapping, n_stages: int, p: int) -> tuple[int, ...]:
    return tuple(mapping(s, n_stages, p) for s in range(n_stages))


# Placement: which device runs each rank. A schedule family decides its stages' ranks with the
# mappings above; `remap` then moves whole rank programs onto devices (rank r -> device d, with
# device d = GPU d % G of node d // G, torchrun's numbering). A permutation of ranks changes no
# order, only which link each transfer crosses. The families number ranks so that rank r holds
# stage r (its lowest), so that order is recovered from any layout, before or after `remap`.

Placement = Callable[[Layout, Topology | None], tuple[int, ...]]
"""A placement policy: the device of each rank of a layout, given the machine."""


def logical_order(layout: Layout) -> list[int]:
    """The ranks in pipeline order: sorted by the lowest stage each holds."""
    lowest = {r: layout.n_stages for r in range(layout.p)}
    for s, r in enumerate(layout.stage_rank):
        lowest[r] = min(lowest[r], s)
    return sorted(range(layout.p), key=lowest.__getitem__)


def mirror_pairs(layout: Layout) -> list[tuple[int, int]]:
    """BPipe's pairs: the i-th rank in pipeline order with the i-th from the end.

    Under 1F1B stage s stashes p-s micro-batches, so the pair (s, p-1-s) holds p+1 together.
    With p odd the middle rank has no partner.
    """
    order = logical_order(layout)
    return [(order[i], order[-1 - i]) for i in range(layout.p // 2)]


def in_order(layout: Layout, topology: Topology | None) -> tuple[int, ...]:
    """`sequential`: rank r on device r."""
    return tuple(range(layout.p))


def pair_adjacent(layout: Layout, topology: Topology | None) -> tuple[int, ...]:
    """Each BPipe pair on two adjacent GPUs of one node (the BPipe re-evaluation's Figure 2).

    Pair i takes devices 2i and 2i+1, the middle rank of an odd p the last device. Pipeline
    neighbours then cross a node boundary twice instead of once, but every evict/load stays on
    the fast intra-node links.
    """
    devices = [layout.p - 1] * layout.p
    for i, (a, b) in enumerate(mirror_pairs(layout)):
        devices[a], devices[b] = 2 * i, 2 * i + 1
    g = topology.gpus_per_node if topology else layout.p
    if any(d // g != (d + 1) // g for d in range(0, 2 * (layout.p // 2), 2)):
        raise PipecError(
            f"--mapping pair-adjacent puts each pair on two adjacent GPUs of one node; "
            f"with --gpus-per-node {g} (odd) a pair would straddle two nodes: use an even number"
        )
    return tuple(devices)


PLACEMENTS: dict[str, Placement] = {"sequential": in_order, "pair-adjacent": pair_adjacent}
"""The placements `--mapping` names; `auto` tries each and keeps the fastest."""


def remap(schedule: Schedule, devices: Sequence[int]) -> Schedule:
    """Move each rank's program to its device: rank r's order runs on device devices[r].

    Expects a permutation of range(p); guarantees the same orders, on permuted ranks.
    """
    if list(devices) == list(range(schedule.p)):
        return schedule
    orders: list = [()] * schedule.p
    for r, d in enumerate(devices):
        orders[d] = schedule.orders[r]
    stage_rank = tuple(devices[r] for r in schedule.layout.stage_rank)
    layout = replace(schedule.layout, stage_rank=stage_rank)
    return replace(schedule, layout=layout, orders=tuple(orders))


def allowed(layout: Layout, topology: Topology | None) -> dict[str, tuple[int, ...]]:
    """The devices of every placement this machine allows, by name."""
    out = {}
    for name, place in PLACEMENTS.items():
        try:
            out[name] = place(layout, topology)
        except PipecError:
            continue
    return out


def auto(
    options: dict[str, tuple[int, ...]], makespan: Callable[[tuple[int, ...]], float | None]
) -> str:
    """`auto`: the name of the option whose programs simulate fastest.

    `makespan(devices)` compiles and simulates a candidate, or gives None when it cannot (a
    memory limit it cannot meet). Ties go to the earlier option, so `sequential` unless
    another placement is strictly faster.
    """
    best: tuple[float, str] | None = None
    for name, devices in options.items():
        t = makespan(devices)
        if t is not None and (best is None or t < best[0] - 1e-9):
            best = (t, name)
    if best is None:
        raise PipecError(f"--mapping auto: none of {', '.join(options)} can be compiled")
    return best[1]
