"""The compile driver: one short function that runs the passes in order.

schedule family -> place on devices, lower (send/recv, optimizer step), evict
(passes/placement.py) -> simulate -> verify -> plan.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from codegen.render import dump_json
from passes.costs import CostModel
from passes.data_parallel import add_dp_sync
from passes.lower import lower
from passes.placement import place
from passes.registry import Request, build_schedule, family
from passes.simulate import Played, SimResult, play, simulate
from passes.verify import verify
from pipec.ir import Compiled, PipecError, Schedule

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


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: compiling builds 10^5-10^6 acyclic tuples, and
    the collector's repeated scans of them made compile time grow faster than p·m."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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
    dp: int = 1,
    evict: bool = False,
    mapping: str = "sequential",
) -> CompileResult:
    """Build a registered family's schedule, then lower, simulate and verify it.

    `dp` > 1 adds data-parallel gradient sync; the world is then p·dp ranks. With `evict`,
    the family builds its schedule without the memory limit and eviction holds every rank
    to it (to the smallest feasible limit when none is given).
    """
    if dp < 1:
        raise PipecError(f"--dp must be at least 1 (got {dp})")
    v = family(schedule).default_v if v is None else v
    with gc_paused():
        req = Request(p, m, v, costs, None if evict else memory_limit)
        sched = build_schedule(schedule, req)
        return compile_from_schedule(sched, costs, memory_limit, model, dp, evict, mapping)


def compile_from_schedule(
    sched: Schedule,
    costs: CostModel = CostModel(),
    memory_limit: float | None = None,
    model: dict | None = None,
    dp: int = 1,
    evict: bool = False,
    mapping: str = "sequential",
) -> CompileResult:
    """Lower, simulate and verify a schedule built anywhere (a family, an imported order)."""
    with gc_paused():
        costs.check_chunks(sched.layout.n_chunks)
        played = None
        if evict or mapping != "sequential":
            compiled, mapping, memory_limit = place(sched, costs, mapping, evict, memory_limit)
        else:  # the common case: one play serves lowering and simulation (orders are kept)
            played = play(sched.layout, sched.orders, costs)
            compiled = lower(sched, costs, played)
        if dp > 1:
            compiled = add_dp_sync(compiled)
        return package(compiled, costs, memory_limit, model, dp, played, evict, mapping)


def package(
    compiled: Compiled,
    costs: CostModel,
    memory_limit: float | None = None,
    model: dict | None = None,
    dp: int = 1,
    played: Played | None = None,
    evict: bool = False,
    mapping: str = "sequential",
) -> CompileResult:
    """Simulate and verify lowered programs and make their plan (also hand-written programs)."""
    sim = simulate(compiled.layout, compiled.programs, costs, played)
    verify(compiled, costs, [r.peak_activations for r in sim.ranks], memory_limit)
    plan = {
        "format": PLAN_FORMAT,
        "schedule": compiled.schedule,
        "p": compiled.p,
        "m": compiled.m,
        "v": compiled.v,
        "world": compiled.world,
        "layout": compiled.layout.to_json(),
        "costs": costs.to_json(),
        "memory_limit": memory_limit,
        "model": model,
    }
    # Keys only where used, so that plans without them (and golden headers) keep their hash.
    if dp > 1:
        plan["dp"] = dp
    if evict:
        plan["evict"] = True
    if mapping != "sequential":
        plan["mapping"] = mapping
    text = dump_json(plan)
    return CompileResult(compiled, sim, costs, plan, text, plan_hash(text))
