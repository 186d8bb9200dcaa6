"""The compile driver: one short function that runs the passes in order.

schedule family -> place on devices, lower (send/recv, optimizer step), evict
(passes/placement.py) -> simulate -> verify -> plan.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from codegen.render import dump_json
from passes.costs import CostModel
from passes.placement import place
from passes.registry import Request, build_schedule, family
from passes.simulate import SimResult, simulate
from passes.verify import verify
from pipec.ir import Compiled

PLAN_FORMAT = "pipec.plan/1"


@dataclass(frozen=True)
class CompileResult:
    """A verified compile: the programs, their simulation, and the plan they belong to."""

    compiled: Compiled
    sim: SimResult
    costs: CostModel
    plan: dict
    plan_text: str
    plan_hash: str


def plan_hash(plan_text: str) -> str:
    """The identity of a plan: programs carry it so the runtime can refuse a mismatch."""
    return hashlib.sha256(plan_text.encode()).hexdigest()[:16]


def compile_schedule(
    schedule: str,
    p: int,
    m: int,
    v: int | None = None,
    costs: CostModel = CostModel(),
    memory_limit: float | None = None,
    model: dict | None = None,
    evict: bool = False,
    mapping: str = "sequential",
) -> CompileResult:
    """Build, lower, simulate and verify a schedule; PipecError for bad input.

    With `evict`, the family builds its schedule without the memory limit and eviction holds
    every rank to it (to the smallest feasible limit when none is given).
    """
    v = family(schedule).default_v if v is None else v
    req = Request(p, m, v, costs, None if evict else memory_limit)
    sched = build_schedule(schedule, req)
    costs.check_chunks(sched.layout.n_chunks)
    compiled, mapping, memory_limit = place(sched, costs, mapping, evict, memory_limit)
    sim = simulate(compiled.layout, compiled.programs, costs)
    verify(compiled, costs, [r.peak_activations for r in sim.ranks], memory_limit)
    plan = {
        "format": PLAN_FORMAT,
        "schedule": schedule,
        "p": p,
        "m": m,
        "v": v,
        "world": compiled.world,
        "layout": compiled.layout.to_json(),
        "costs": costs.to_json(),
        "memory_limit": memory_limit,
        "model": model,
    }
    if evict:  # keys only where used, so that plans without them keep their hash
        plan["evict"] = True
    if mapping != "sequential":
        plan["mapping"] = mapping
    text = dump_json(plan)
    return CompileResult(compiled, sim, costs, plan, text, plan_hash(text))
