"""The compile driver: one short function that runs the passes in order.

schedule family -> place on devices, lower (send/recv, optimizer step), evict
(passes/placement.py) -> simulate -> verify -> plan.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

from pipec.beside import beside
from pipec.codegen.render import dump_json
from pipec.ir import Compiled, PipecError, Program, Schedule, instruction_count
from pipec.passes.costs import CostModel
from pipec.passes.data_parallel import add_dp_sync
from pipec.passes.forward_only import forward_only, verify_forward
from pipec.passes.lower import lower
from pipec.passes.placement import place
from pipec.passes.registry import Request, build_schedule, family
from pipec.passes.residency import check_stash_bytes
from pipec.passes.simulate import Played, SimResult, play, simulate
from pipec.passes.verify import check_execution, verify

PLAN_FORMAT = "pipec.plan/1"
UNIT_COSTS = CostModel()  # F=B=W=1 per rank's share, comm 0: the default (frozen, shared)


@dataclass(frozen=True)
class Options:
    """How to compile a schedule beyond its shape; the defaults change nothing in the plan.

    `dp` > 1 adds data-parallel gradient sync (a world of p·dp ranks). With `evict`, eviction
    holds every rank to `memory_limit` (to the smallest feasible limit when none is given).
    `limit_in_bytes`: the limit is bytes of stash per rank (needs the model's
    `costs.stash_bytes`), checked against the simulated bytes. `precision`: the run's
    `--precision` those bytes are priced at (passes/memory_bytes.stashes_at).
    """

    costs: CostModel = UNIT_COSTS
    memory_limit: float | None = None
    model: dict | None = None
    dp: int = 1
    evict: bool = False
    mapping: str = "sequential"
    limit_in_bytes: bool = False
    precision: str = "fp32"


@dataclass(frozen=True)
class CompileResult:
    """A verified compile: the programs, their simulation, and the plan they belong to; with
    a model, the verified evaluation programs too (passes/forward_only.py)."""

    compiled: Compiled
    sim: SimResult
    costs: CostModel
    plan: dict
    plan_text: str
    plan_hash: str
    eval_programs: tuple[Program, ...] = ()


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


#: The most ranks (p·dp) a build may have: far beyond any machine, and a guard against a typo.
MAX_RANKS = 65536


def check_dp(dp: int, p: int) -> None:
    """Raise PipecError unless `dp` copies of a `p`-rank pipeline make a sensible world."""
    if dp < 1:
        raise PipecError(f"--dp must be at least 1 (got {dp})")
    if dp * p > MAX_RANKS:
        raise PipecError(
            f"--dp {dp}: {dp * p} ranks in all (p={p}); pipec builds at most {MAX_RANKS} ranks"
        )


def plan_hash(plan_text: str) -> str:
    """The identity of a plan: programs carry it so the runtime can refuse a mismatch."""
    return hashlib.sha256(plan_text.encode()).hexdigest()[:16]


def compile_schedule(
    schedule: str,
    p: int,
    m: int,
    v: int | None = None,
    costs: CostModel = UNIT_COSTS,
    memory_limit: float | None = None,
    model: dict | None = None,
    dp: int = 1,
    evict: bool = False,
    mapping: str = "sequential",
    limit_in_bytes: bool = False,
    precision: str = "fp32",
) -> CompileResult:
    """Build a registered family's schedule, then lower, simulate and verify it (the options
    are `Options`'). The family sees the memory limit unless eviction or bytes enforce it."""
    opts = Options(costs, memory_limit, model, dp, evict, mapping, limit_in_bytes, precision)
    check_dp(dp, p)
    v = family(schedule).default_v if v is None else v
    with gc_paused():
        req = Request(p, m, v, costs, None if evict or limit_in_bytes else memory_limit)
        return compile_from_schedule(build_schedule(schedule, req), opts)


def compile_from_schedule(sched: Schedule, opts: Options = Options()) -> CompileResult:
    """Lower, simulate and verify a schedule built anywhere (a family, an imported order).
    Costs given for a rank's share are taken per chunk op (`CostModel.of_chunks`) first: every
    pass after this one, and the plan, read them so."""
    with gc_paused():
        opts.costs.check_chunks(sched.layout.n_chunks)
        opts = replace(opts, costs=opts.costs.of_chunks(sched.layout.stash_share))
        played = None
        if opts.evict or opts.mapping != "sequential":
            compiled, mapping, memory_limit = place(
                sched,
                opts.costs,
                opts.mapping,
                opts.evict,
                opts.memory_limit,
                opts.limit_in_bytes,
            )
            opts = replace(opts, mapping=mapping, memory_limit=memory_limit)
        else:  # the common case: one play serves lowering and simulation (orders are kept)
            played = play(sched.layout, sched.orders, opts.costs)
            compiled = lower(sched, opts.costs, played)
        if opts.dp > 1:
            compiled = add_dp_sync(compiled)
        return package(compiled, opts, played)


def package(
    compiled: Compiled, opts: Options = Options(), played: Played | None = None
) -> CompileResult:
    """Simulate and verify lowered programs and make their plan (also hand-written programs)."""
    costs, limit = opts.costs.of_chunks(compiled.layout.stash_share), opts.memory_limit
    stashes_limit = None if opts.limit_in_bytes else limit
    # Invariants 2-3 (the blocking execution) need no simulation: on a large compile they are
    # checked on the other core while this one simulates and checks the rest.
    with beside(partial(check_execution, compiled), instruction_count(compiled)):
        # The orders' play lacks the sends and receives the runtime's cost per instruction
        # is charged for: the lowered programs are played again then.
        sim = simulate(
            compiled.layout, compiled.programs, costs, None if costs.instr_overhead else played
        )
        peaks = [r.peak_activations for r in sim.ranks]
        verify(compiled, costs, peaks, stashes_limit, execution=False, dp=opts.dp)
    if opts.limit_in_bytes:
        check_stash_bytes(sim, limit)
    plan = {
        "format": PLAN_FORMAT,
        "schedule": compiled.schedule,
        "p": compiled.p,
        "m": compiled.m,
        "v": compiled.v,
        "world": compiled.world,
        "layout": compiled.layout.to_json(),
        "costs": costs.to_json(),
        "memory_limit": stashes_limit,
        "model": opts.model,
    }
    # Keys only where used, so that plans without them (and golden headers) keep their hash.
    if opts.dp > 1:
        plan["dp"] = opts.dp
    if opts.evict:
        plan["evict"] = True
    if opts.mapping != "sequential":
        plan["mapping"] = opts.mapping
    if opts.limit_in_bytes:
        plan["memory_limit_bytes"] = limit
    if opts.precision != "fp32":
        plan["precision"] = opts.precision  # what `costs` prices stashes at
    text = dump_json(plan)
    evaluation: tuple[Program, ...] = ()
    if opts.model is not None:  # only a build with a model runs, and evaluates
        evaluation = forward_only(compiled.programs)
        verify_forward(replace(compiled, programs=evaluation))
    return CompileResult(compiled, sim, costs, plan, text, plan_hash(text), evaluation)
