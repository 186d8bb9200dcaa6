"""The compile driver: one short function that runs the passes in order.

schedule family -> lower (send/recv, optimizer step) -> simulate -> verify -> plan.
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
) -> CompileResult:
    """Build a registered family's schedule, then lower, simulate and verify it.

    `dp` > 1 adds data-parallel gradient sync; the world is then p·dp ranks.
    """
    if dp < 1:
        raise PipecError(f"--dp must be at least 1 (got {dp})")
    v = family(schedule).default_v if v is None else v
    with gc_paused():
        sched = build_schedule(schedule, Request(p, m, v, costs, memory_limit))
        return compile_from_schedule(sched, costs, memory_limit, model, dp)


def compile_from_schedule(
    sched: Schedule,
    costs: CostModel = CostModel(),
    memory_limit: float | None = None,
    model: dict | None = None,
    dp: int = 1,
) -> CompileResult:
    """Lower, simulate and verify a schedule built anywhere (a family, an imported order)."""
    with gc_paused():
        costs.check_chunks(sched.layout.n_chunks)
        played = play(sched.layout, sched.orders, costs)  # lowering keeps the compute orders
        compiled = lower(sched, costs, played)
        if dp > 1:
            compiled = add_dp_sync(compiled)
        return package(compiled, costs, memory_limit, model, dp, played)


def package(
    compiled: Compiled,
    costs: CostModel,
    memory_limit: float | None = None,
    model: dict | None = None,
    dp: int = 1,
    played: Played | None = None,
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
    if dp > 1:  # absent for dp=1, so schedule-only plans (and golden headers) keep their hash
        plan["dp"] = dp
    text = dump_json(plan)
    return CompileResult(compiled, sim, costs, plan, text, plan_hash(text))
