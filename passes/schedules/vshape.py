"""V-Min, V-Half and V-ZB: the controllable-memory V-shape schedules (Qi et al., NeurIPS 2024).

Each is one building block (vblocks) turned into a schedule by repeat-squeeze-reorder
(vreorder). The blocks differ in how far apart micro-batch 0's passes are on consecutive
ranks; the lifespan of a stage (its F to its W) bounds its rank's memory, so the spacing sets
the memory: V-Min about a third of 1F1B's, V-Half a half, V-ZB all of it (and zero bubble).
Start slots on rank r (d = p), from the reference implementation:

    V-Min:  F = r,  f = 2d-1-r, B = 2d+I+r,    b = 4d+I-1-r,  I = 2 if d % 3 == 0 else 0
    V-Half: F = 2r, f = 3d-2-r, B = 3d+I+2r-1, b = 6d+I-2-r,  I = 3 if d is even else 0
    V-ZB:   F = 5r, f = 6d-5-r, B = 6d-4+5r,   b = 12d-9-r

(I moves the backward so that no two passes of a rank share a slot modulo 6.)

A family emits the shortest, under the costs the user gave, of its block's schedules (the
paper's cool-down and list scheduling's, vreorder) and the peer's published order for the same
placement and memory: the zero-bubble repository's V-Min and V-Half (vgreedy), torch's ZB-V for
V-ZB (zbv_fixed); none may raise a rank's peak above the block's own schedules' (vbest).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from pipec.ir import Schedule, single_pipeline
from pipec.passes.mapping import stage_ranks, v_shape
from pipec.passes.registry import Request, only_v, schedule
from pipec.passes.schedules import vgreedy
from pipec.passes.schedules.limits import refuse_over_limit
from pipec.passes.schedules.vbest import rank_peaks, shortest
from pipec.passes.schedules.vblocks import Block, Orders, T, block_from_residues, to_programs
from pipec.passes.schedules.vreorder import variants
from pipec.passes.schedules.zbv_fixed import zbv_orders

Slots = Callable[[int, int], tuple[int, int, int, int]]


def v_min_slots(p: int, r: int) -> tuple[int, int, int, int]:
    i = 2 if p % 3 == 0 else 0
    return r, 2 * p - 1 - r, 2 * p + i + r, 4 * p + i - 1 - r


def v_half_slots(p: int, r: int) -> tuple[int, int, int, int]:
    i = 3 if p % 2 == 0 else 0
    return 2 * r, 3 * p - 2 - r, 3 * p + i + 2 * r - 1, 6 * p + i - 2 - r


def v_zb_slots(p: int, r: int) -> tuple[int, int, int, int]:
    return 5 * r, 6 * p - 5 - r, 6 * p - 4 + 5 * r, 12 * p - 9 - r


def block_of(slots: Slots, p: int) -> Block:
    block = block_from_residues(p, [[s % T for s in slots(p, r)] for r in range(p)])
    assert block is not None, "the published offsets never collide"
    return block


def check_v(req: Request) -> str | None:
    """The V placement needs two ranks (so that it bends) and two micro-batches."""
    if req.p < 2:
        return f"--pp must be at least 2 for a V placement (got {req.p})"
    if req.m < 2:
        return f"--microbatches must be at least 2 (got {req.m})"
    return None


def v_family(
    name: str, summary: str
) -> Callable[[Callable[[Request], Schedule]], Callable[[Request], Schedule]]:
    """Register a V-placed family: two chunks per rank, p >= 2, m >= 2."""
    return schedule(name, summary, default_v=2, chunks="2", checks=(only_v(2), check_v))


def v_schedule(name: str, req: Request, orders: Orders) -> Schedule:
    """The Schedule of V-placed orders; a --memory-limit under its peak is refused here."""
    p = req.p
    layout = single_pipeline(p, req.m, stage_ranks(v_shape, 2 * p, p))
    sched = Schedule(name, p, req.m, 2, layout, to_programs(p, orders))
    return refuse_over_limit(sched, req, "v-adaptive")


def reference_orders(slots: Slots, p: int, m: int) -> Orders:
    """The zero-bubble repository's orders for the block of `slots` (its V-Min/V-Half)."""
    return vgreedy.orders([slots(p, r) for r in range(p)], m)


def peer_orders(p: int, m: int) -> list[Orders]:
    """The orders peers publish for the V placement: torch's ZB-V (p stashes) and the
    zero-bubble repository's V-Half and V-Min."""
    return [
        zbv_orders(p, m),
        reference_orders(v_half_slots, p, m),
        reference_orders(v_min_slots, p, m),
    ]


def _family(name: str, slots: Slots, summary: str, peers: Callable[[int, int], Orders]) -> None:
    def build_family(req: Request) -> Schedule:
        own = variants(block_of(slots, req.p), req.m)
        assert own, f"{name} builds for every p >= 2, m >= 2"
        bound = [max(x) for x in zip(*(rank_peaks(orders, req.costs) for orders in own))]
        orders = shortest([*own, peers(req.p, req.m)], req.costs, bound)
        assert orders is not None  # the family's own orders are within its bound
        return v_schedule(name, req, orders)

    build_family.__doc__ = f"{name}: {summary}"
    v_family(name, summary)(build_family)


_family(
    "v-min",
    v_min_slots,
    "V-shape, ~1/3 of 1F1B's activations ((p+4)//3 stashes), bubble ~4p",
    partial(reference_orders, v_min_slots),
)
_family(
    "v-half",
    v_half_slots,
    "V-shape, ~1/2 of 1F1B's activations ((p+2)//2 stashes), bubble ~3p",
    partial(reference_orders, v_half_slots),
)
_family(
    "v-zb",
    v_zb_slots,
    "V-shape building block with 1F1B's activations (p stashes), zero bubble",
    zbv_orders,
)
