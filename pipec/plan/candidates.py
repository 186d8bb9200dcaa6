"""Enumerate candidates (schedule × micro-batch size × memory strategy), price and simulate them.

A memory strategy is a row of `STRATEGIES`: a function that turns the compile request of a
schedule family into the requests that save memory its way, tried in order until one compiles
(none where it does not apply).
Adding one (the eviction pass, an offload) is one function and one row; nothing else branches
on its name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipec.compile import CompileResult, compile_schedule
from pipec.ir import Layout, Op, PipecError
from pipec.passes.costs import CostModel
from pipec.passes.memory_bytes import RankBytes, Samples, held_chunks
from pipec.passes.registry import SCHEDULES, Request, build_schedule, family
from pipec.passes.simulate import SimResult
from pipec.passes.topology import Link, Topology
from pipec.plan.facts import Chunks, ModelProfile
from pipec.plan.memory import predicted, stash_limit

RECOMPUTE_SUFFIX = "-r"
"""A family `X-r` registered beside `X` is X with full recomputation (1f1b-r)."""
BASELINE = "1f1b"


@dataclass(frozen=True)
class CompileRequest:
    """What `compile_schedule` is called with; `options` are extra keyword arguments."""

    schedule: str
    p: int
    m: int
    v: int
    memory_limit: float | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "p": self.p,
            "m": self.m,
            "v": self.v,
            "memory_limit": self.memory_limit,
            "options": dict(self.options),
        }


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked to plan: the pipeline, the batch, the memory per device, and the
    families and strategies to consider (empty: all)."""

    p: int
    global_batch: int
    bytes_per_device: int
    dp: int = 1
    schedules: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    comm_s: float = 0.0
    machine: Topology | None = None
    """Nodes and links, bandwidths in bytes per second and latencies in seconds (None: every
    transfer takes `comm_s`)."""
    precision: str = "fp32"
    """`launch.py --precision` of the run planned for (bf16: bf16 activations and weights,
    fp32 gradients, masters and optimizer state)."""
    zero: bool = False
    """`launch.py --zero 1`: masters and optimizer state sharded over the dp copies."""
    instr_s: tuple[tuple[int, float], ...] = ()
    """The runtime's own seconds per instruction, by micro-batch size (a calibration measures
    them, `at_size` reads them; empty: not counted)."""

    @property
    def shards(self) -> int:
        """The copies the optimizer state is sharded over (1: none)."""
        return self.dp if self.zero else 1


@dataclass(frozen=True)
class Budget:
    """The memory a strategy may plan for: `stash_limit` is the most activation memory, in the
    simulator's stash units, every rank can hold within the byte budget beside what eviction
    cannot move (`pipec.plan.memory.stash_limit`)."""

    bytes_per_device: int
    stash_limit: float


Transform = Callable[[CompileRequest, Budget], tuple[CompileRequest, ...]]


def _plain(req: CompileRequest, budget: Budget) -> tuple[CompileRequest, ...]:
    return (req,)


def _recompute(req: CompileRequest, budget: Budget) -> tuple[CompileRequest, ...]:
    variant = req.schedule + RECOMPUTE_SUFFIX
    return (replace(req, schedule=variant),) if variant in SCHEDULES else ()


def _evict(req: CompileRequest, budget: Budget) -> tuple[CompileRequest, ...]:
    # BPipe (passes/evict.py, as `pipec compile --evict`): evict only what the budget's limit
    # requires. Where the pass refuses that limit, the smallest limit it can meet (no limit
    # given) is the candidate: over the budget, it tells how much memory eviction needs.
    evict = replace(req, options=(("evict", True),))
    return replace(evict, memory_limit=budget.stash_limit), evict


STRATEGIES: dict[str, tuple[str, Transform]] = {
    "plain": ("the schedule as it is", _plain),
    "recompute": ("full recomputation: stash stage inputs, re-run F before B", _recompute),
    "evict": ("BPipe: evict stashes to a paired rank within the budget", _evict),
}


def at_size(table: Sequence[tuple[int, float]], mbs: int, default: float = 0.0) -> float:
    """The value of `table` ((size, value) pairs) at micro-batch size `mbs`: at the nearest
    size it holds (by ratio; the smaller on a tie), `default` when empty."""
    if not table:
        return default
    return min((abs(math.log2(n / mbs)), n, value) for n, value in table)[2]


def schedule_names(requested: Sequence[str] | None) -> list[str]:
    """The families to enumerate: the requested ones, or every registered family that is not
    a recompute variant (those are the `recompute` strategy); the 1F1B baseline always."""
    family(BASELINE)  # registers the built-in families
    if requested:
        for name in requested:
            family(name)  # one line listing the valid names for a typo
        names = list(requested)
    else:
        names = sorted(n for n in SCHEDULES if not is_recompute_variant(n))
    return names if BASELINE in names else [BASELINE, *names]


def is_recompute_variant(name: str) -> bool:
    return name.endswith(RECOMPUTE_SUFFIX) and name[: -len(RECOMPUTE_SUFFIX)] in SCHEDULES


def strategy_names(requested: Sequence[str] | None) -> list[str]:
    if not requested:
        return list(STRATEGIES)
    for name in requested:
        if name not in STRATEGIES:
            raise PipecError(
                f"--strategies: unknown strategy '{name}'; available: {', '.join(STRATEGIES)}"
            )
    return list(requested)


@dataclass(frozen=True)
class Evaluated:
    """One compiled and simulated candidate: the request that compiles it (to reproduce it
    with a model), its figures and each rank's predicted peak bytes, by term."""

    family: str
    strategy: str
    mbs: int
    request: CompileRequest
    iteration_s: float
    bubble: float
    memory: tuple[RankBytes, ...]
    costs: CostModel = field(repr=False, compare=False)
    chunks: Chunks = field(repr=False, compare=False)
    layout: Layout = field(repr=False, compare=False)  # what the model is cut into

    @property
    def schedule(self) -> str:
        return self.request.schedule

    @property
    def m(self) -> int:
        return self.request.m

    @property
    def peak_bytes(self) -> int:
        return max(r.total for r in self.memory)


@dataclass(frozen=True)
class Skipped:
    family: str
    strategy: str
    mbs: int
    reason: str


@dataclass
class Evaluation:
    """Every candidate, split into those that fit the budget, those over it, and those the
    schedule's rules or the strategy refused (with the reason)."""

    fits: list[Evaluated] = field(default_factory=list)
    over: list[Evaluated] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def cost_model(
    chunks: Chunks,
    layout: Layout,
    comm_s: float = 0.0,
    machine: Topology | None = None,
    instr_s: float = 0.0,
) -> CostModel:
    """Per-chunk F/B/W in seconds and stash bytes; memory in stashes, recompute keeping the
    largest share of its stash any chunk's input takes (conservative where chunks differ);
    `instr_s`, the runtime's seconds per instruction.

    The simulator sizes a transfer in stash units (a rank's full share of the model); the
    heaviest chunk prices the unit in bytes, so the machine's bytes-per-second links become
    stash units per second and a message or an evicted stash crosses a link in about its
    byte size over the link's bandwidth, plus the latency. The all-reduce of two replicas'
    gradients (Chimera, BitPipe, DualPipe) is priced as a ring of two ranks moves them: two
    latencies and the heaviest chunk's gradient bytes over the link (0 when transfers are).
    """
    keep = max(i / s for i, s in zip(chunks.input_bytes, chunks.stash_bytes))
    topology = None
    if machine is not None:
        unit = max(chunks.stash_bytes) / layout.stash_share

        def link(k: Link) -> Link:
            return Link(k.bandwidth / unit, k.latency)

        topology = replace(machine, intra=link(machine.intra), inter=link(machine.inter))
    if machine is None:
        pair = Link(float("inf"), comm_s)
    else:  # a replica's rank may be on another node: the slower link, to be safe
        pair = machine.inter if machine.nodes > 1 else machine.intra
    grads = max(chunks.param_bytes, default=0)
    allreduce = 2 * pair.latency + grads / pair.bandwidth if layout.replica else 0.0
    return CostModel(
        F=tuple(c.F for c in chunks.seconds),
        B=tuple(c.B for c in chunks.seconds),
        W=tuple(c.W for c in chunks.seconds),
        comm=comm_s,
        mem_input=min(keep, 1.0),
        stash_bytes=tuple(float(b) for b in chunks.stash_bytes),
        topology=topology,
        per="chunk",  # measured per chunk: not divided again
        instr_overhead=instr_s,
        allreduce=allreduce,
    )


def iteration_time(sim: SimResult, layout: Layout, chunks: Chunks) -> float:
    """The makespan, or later where a rank's optimizer step (measured per chunk; the runtime
    runs it after the rank's last op and its replica all-reduces) ends after it: an iteration
    ends when the slowest rank has stepped."""
    if not chunks.optimizer_s:
        return sim.makespan
    steps = [
        (slots[-1].end if slots else 0.0)
        + sim.ranks[r].sync
        + sum(chunks.optimizer_s[c] for c in held_chunks(layout, r))
        for r, slots in enumerate(sim.timeline)
    ]
    return max(sim.makespan, *steps)


def price(
    profile: ModelProfile,
    name: str,
    req: Request,
    mbs: int,
    comm_s: float = 0.0,
    machine: Topology | None = None,
    precision: str = "fp32",
    instr_s: float = 0.0,
) -> tuple[Layout, Chunks, CostModel]:
    """Family `name`'s layout for `req`, its chunks at `mbs` (at `precision`) and their cost
    model: a family whose programs have no W runs BW, priced by the one-pass backward."""
    sched = build_schedule(name, req)
    layout = sched.layout
    chunks = profile.chunks(layout.n_chunks, mbs)
    if precision == "bf16":
        chunks = chunks.at_bf16()
    if not any(i.op is Op.W for order in sched.orders for i in order):
        chunks = chunks.fused()
    return layout, chunks, cost_model(chunks, layout, comm_s, machine, instr_s)


def _compile(job: CompileRequest, costs: CostModel) -> CompileResult:
    return compile_schedule(
        job.schedule, job.p, job.m, job.v, costs, job.memory_limit, **dict(job.options)
    )


def _first_that_compiles(
    jobs: Sequence[CompileRequest], costs: CostModel, done: dict[CompileRequest, CompileResult]
) -> tuple[CompileRequest, CompileResult]:
    """The first of `jobs` that compiles, with its result (from `done` where compiled
    already); the first refusal if none does."""
    first: PipecError | None = None
    for job in jobs:
        try:
            return job, done[job] if job in done else _compile(job, costs)
        except PipecError as e:
            first = first or e
    assert first is not None
    raise first


def _evaluated(
    name: str,
    strategy: str,
    mbs: int,
    job: CompileRequest,
    result: CompileResult,
    chunks: Chunks,
    costs: CostModel,
    samples: Sequence[Samples],
) -> Evaluated:
    layout = result.compiled.layout
    return Evaluated(
        name,
        strategy,
        mbs,
        job,
        iteration_time(result.sim, layout, chunks),
        result.sim.bubble,
        tuple(s.peak() for s in samples),
        costs,
        chunks,
        layout,
    )


def evaluate(profile: ModelProfile, req: PlanRequest) -> Evaluation:
    """Compile and simulate every candidate at every profiled micro-batch size; predict each
    one's bytes per rank on the profiled device."""
    p, dp, bytes_per_device = req.p, req.dp, req.bytes_per_device
    schedules, strategies = schedule_names(req.schedules), strategy_names(req.strategies)
    out = Evaluation()
    seen: dict[tuple[int, tuple], str] = {}  # (mbs, programs) -> strategy that produced them
    for mbs in profile.sizes:
        m = req.global_batch // (mbs * dp)
        for name in schedules:
            v = family(name).default_v
            plain = CompileRequest(name, p, m, v)
            try:
                layout, chunks, costs = price(
                    profile,
                    name,
                    Request(p, m, v),
                    mbs,
                    req.comm_s,
                    req.machine,
                    req.precision,
                    at_size(req.instr_s, mbs),
                )
                # The family's own programs: the plain row, and what the budget's limit is
                # derived from (what eviction cannot move).
                done = {plain: _compile(plain, costs)}
            except PipecError as e:
                out.skipped += [Skipped(name, s, mbs, str(e)) for s in strategies]
                continue
            unmoved = predicted(done[plain], chunks, profile.device, req.precision, req.shards)
            limit = stash_limit(layout, costs.stash_bytes, unmoved, bytes_per_device)
            budget = Budget(bytes_per_device, limit)
            for strategy in strategies:
                jobs = STRATEGIES[strategy][1](plain, budget)
                if not jobs:
                    out.skipped.append(Skipped(name, strategy, mbs, "does not apply"))
                    continue
                try:
                    job, result = _first_that_compiles(jobs, costs, done)
                except PipecError as e:
                    out.skipped.append(Skipped(name, strategy, mbs, str(e)))
                    continue
                key = (mbs, result.compiled.programs)
                if key in seen:  # e.g. eviction under a budget plain already meets
                    out.skipped.append(Skipped(name, strategy, mbs, f"same as {seen[key]}"))
                    continue
                seen[key] = f"{name} {strategy}"
                samples = (
                    unmoved
                    if job == plain
                    else predicted(result, chunks, profile.device, req.precision, req.shards)
                )
                ev = _evaluated(name, strategy, mbs, job, result, chunks, costs, samples)
                (out.fits if ev.peak_bytes <= bytes_per_device else out.over).append(ev)
    out.fits.sort(key=lambda e: (e.iteration_s, e.peak_bytes))
    return out


def evaluate_one(
    profile: ModelProfile,
    job: CompileRequest,
    mbs: int,
    comm_s: float = 0.0,
    machine: Topology | None = None,
    instr_s: float = 0.0,
) -> Evaluated:
    """The candidate `job` at `mbs`, priced, compiled and simulated as `evaluate` does it: for
    a job `evaluate` ranked, this is that row (`pipec compile --plan-profile` rebuilds it)."""
    name = job.schedule
    if is_recompute_variant(name):
        name = name.removesuffix(RECOMPUTE_SUFFIX)
    request = Request(job.p, job.m, job.v)
    _, chunks, costs = price(profile, name, request, mbs, comm_s, machine, instr_s=instr_s)
    result = _compile(job, costs)
    samples = predicted(result, chunks, profile.device)
    return _evaluated(name, strategy_of(job), mbs, job, result, chunks, costs, samples)


def strategy_of(job: CompileRequest) -> str:
    """The name of the strategy whose transform in `STRATEGIES` yields `job`."""
    if dict(job.options).get("evict"):
        return "evict"
    return "recompute" if is_recompute_variant(job.schedule) else "plain"
