"""From a schedule to lowered programs on devices, within a memory limit.

    remap (placement: rank -> device) -> lower -> insert_evictions (with --evict)

The schedule family decides each rank's order; placing ranks on devices afterwards changes no
order, only which link each transfer crosses, so lowering (whose message order follows the
simulated send times) and eviction (whose prefetch follows transfer times) run after it.
`auto` compiles every placement the machine allows and keeps the fastest, at one memory limit
for all: the one given, or with a bare --evict the smallest any of them can meet.
"""

from __future__ import annotations

from functools import cache

from pipec.ir import Compiled, PipecError, Schedule
from pipec.passes.costs import CostModel
from pipec.passes.evict import EvictionPlanner
from pipec.passes.lower import lower
from pipec.passes.mapping import PLACEMENTS, allowed, auto, remap
from pipec.passes.simulate import simulate

MAPPINGS = (*PLACEMENTS, "auto")


def place(
    schedule: Schedule,
    costs: CostModel,
    mapping: str,
    evict: bool,
    limit: float | None,
    in_bytes: bool = False,
) -> tuple[Compiled, str, float | None]:
    """The lowered (with `evict`, evicted) programs, the placement used and the limit (in
    stashes per rank, or with `in_bytes` in bytes of stash per rank)."""
    if mapping not in MAPPINGS:
        raise PipecError(f"unknown --mapping '{mapping}'; valid: {', '.join(MAPPINGS)}")
    layout, topology = schedule.layout, costs.topology
    if topology is not None and topology.world != layout.p:
        raise PipecError(
            f"the topology has {topology.world} GPUs but the pipeline {layout.p} ranks; "
            "one rank runs on each GPU"
        )
    if mapping == "auto":
        options = allowed(layout, topology)
    else:  # a placement the machine rules out says why
        options = {mapping: PLACEMENTS[mapping](layout, topology)}

    @cache
    def lowered(devices: tuple[int, ...]) -> Compiled:
        return lower(remap(schedule, devices), costs)

    @cache
    def planner(devices: tuple[int, ...]) -> EvictionPlanner:
        return EvictionPlanner(lowered(devices), costs, in_bytes)

    if evict and limit is None:
        limit = min(planner(d).smallest_feasible() for d in options.values())

    @cache
    def build(devices: tuple[int, ...]) -> Compiled:
        return planner(devices).evict(limit) if evict else lowered(devices)

    def makespan(devices: tuple[int, ...]) -> float | None:
        try:
            compiled = build(devices)
        except PipecError:  # a limit this placement cannot meet
            return None
        return simulate(compiled.layout, compiled.programs, costs).makespan

    name = auto(options, makespan) if mapping == "auto" else mapping
    return build(options[name]), name, limit
