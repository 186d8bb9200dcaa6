"""Refusing a --memory-limit that a fixed schedule cannot meet, with the figure that would do.

A family whose peak is fixed by its design (ZB-H1, ZB-H2, the V-shape blocks) cannot trade
time for memory; the verifier would reject its program at the first instruction over the
limit. Saying the schedule's peak instead tells the user what to ask for.
"""

from collections.abc import Sequence

from pipec.ir import Instr, Layout, PipecError, Schedule
from pipec.passes.costs import CostModel
from pipec.passes.registry import Request
from pipec.passes.simulate import activation_profile


def peak_stashes(sched: Schedule, costs: CostModel) -> float:
    """The largest per-rank peak of live activations under the cost model, in stashes."""
    return peak_of(sched.orders, sched.layout, costs)


def peak_of(orders: Sequence[Sequence[Instr]], layout: Layout, costs: CostModel) -> float:
    """`peak_stashes` of compute orders not yet made a Schedule."""
    return max(max(activation_profile(o, layout, costs, False), default=0.0) for o in orders)


def refuse_over_limit(sched: Schedule, req: Request, instead: str) -> Schedule:
    """`sched`, unless its peak exceeds --memory-limit: then one line naming the peak."""
    if req.memory_limit is None:
        return sched
    top = peak_stashes(sched, req.costs)
    if top > req.memory_limit + 1e-9:
        raise PipecError(
            f"{sched.name} peaks at {top:g} stashes at p={sched.p}, m={sched.m}: --memory-limit "
            f"{req.memory_limit:g} is below it; use at least {top:g}, or {instead}"
        )
    return sched
