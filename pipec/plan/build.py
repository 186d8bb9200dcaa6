"""Compile a plan's candidate for its model: the very programs the plan simulated, runnable.

`pipec compile MODEL` prices a build from the frontend's FLOP estimate; lowering orders sends
and the eviction pass picks its moves by simulated times, so a build priced that way can hold
other programs than the candidate the plan ranked. Here the build keeps the plan's own cost
model (the profiled per-chunk F/B/W and stash bytes at the candidate's micro-batch size, times
converted to ms, the unit of model builds), beside the model section the runtime needs
to rebuild the stages: the frontend's balanced partition, which is the one the profile priced.
Its `OUT/measured/stats.json` then compares a run with exactly the plan's prediction.
"""

from __future__ import annotations

from dataclasses import replace

from passes.costs import CostModel
from passes.registry import Request, build_schedule
from passes.topology import Link
from pipec.compile import CompileResult, compile_schedule
from pipec.ir import PipecError
from pipec.model import MS_PER_S, model_plan
from pipec.plan.candidates import Evaluated

COST_SOURCE = "pipec plan profile"


def in_ms(costs: CostModel) -> CostModel:
    """The plan's cost model (seconds) in ms: durations scale, bandwidths per ms shrink."""

    def link(k: Link) -> Link:
        return Link(k.bandwidth / MS_PER_S, k.latency * MS_PER_S)

    topo = costs.topology
    return replace(
        costs,
        F=tuple(x * MS_PER_S for x in costs.F),
        B=tuple(x * MS_PER_S for x in costs.B),
        W=tuple(x * MS_PER_S for x in costs.W),
        comm=costs.comm * MS_PER_S,
        allreduce=costs.allreduce * MS_PER_S,
        topology=None
        if topo is None
        else replace(topo, intra=link(topo.intra), inter=link(topo.inter)),
    )


def compile_candidate(ev: Evaluated, spec: str) -> CompileResult:
    """Compile `ev` for the model of `spec`, whose factory must give micro-batches of `ev.mbs`."""
    job = ev.request
    layout = build_schedule(job.schedule, Request(job.p, job.m, job.v)).layout
    model = model_plan(spec, layout, "balanced", profile=False)
    batch = model["stages"][0]["inputs"][0]["shape"][0]
    if batch != ev.mbs:
        raise PipecError(
            f"{spec} gives micro-batches of {batch} samples; the candidate needs {ev.mbs}"
        )
    model["cost"]["source"] = COST_SOURCE
    return compile_schedule(
        job.schedule,
        job.p,
        job.m,
        job.v,
        in_ms(ev.costs),
        job.memory_limit,
        model=model,
        **dict(job.options),
    )
