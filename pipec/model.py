"""Compile a schedule for a real model: the frontend's stage facts become the cost model.

The schedule's layout says how many model chunks there are (S = p·v, and how many replicas a
bidirectional schedule holds); the frontend captures and partitions the model into that many
stages and measures them; their F/B/W durations (in ms, the cost model's unit) and stash bytes
drive lowering, simulation and the memory figures, and the plan goes under plan.json's "model".
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipec.compile import CompileResult, Options, compile_from_schedule, compile_schedule
from pipec.ir import Layout, PipecError
from pipec.passes.costs import CostModel
from pipec.passes.memory_bytes import stashes_at
from pipec.passes.registry import Request, build_schedule, family

MS_PER_S = 1000.0


def model_costs(model: dict, base: CostModel) -> CostModel:
    """`base` with per-chunk F/B/W (ms) and stash bytes taken from a model plan's stages: each
    chunk's measured time, so costs per chunk op (`base`'s comm and allreduce are kept as
    they are: give them per chunk op, `CostModel.of_chunks`)."""
    stages = model["stages"]

    def per_chunk(kind: str) -> tuple[float, ...]:
        return tuple(s["seconds"][kind] * MS_PER_S for s in stages)

    return replace(
        base,
        F=per_chunk("F"),
        B=per_chunk("B"),
        W=per_chunk("W"),
        stash_bytes=tuple(float(s["stash_bytes"]) for s in stages),
        input_bytes=tuple(float(sum(map(tensor_bytes, s["inputs"]))) for s in stages),
        per="chunk",
    )


def tensor_bytes(facts: dict) -> int:
    """Bytes of a boundary tensor described by its facts' JSON (shape and dtype)."""
    import torch  # only with a model

    return math.prod(facts["shape"]) * getattr(torch, facts["dtype"]).itemsize


def compile_model(
    spec: str,
    schedule: str,
    p: int,
    m: int,
    v: int | None = None,
    costs: CostModel | None = None,
    memory_limit: float | None = None,
    partition: str = "balanced",
    profile: bool = False,
    dp: int = 1,
    evict: bool = False,
    mapping: str = "sequential",
    limit_in_bytes: bool = False,
    device: str | None = None,
    micro_batch_size: int | None = None,
    *,
    split_points: tuple[str, ...] | None = None,
    precision: str = "fp32",
) -> CompileResult:
    """Capture and measure the model of `spec` for this schedule's layout, then compile
    (`limit_in_bytes`: `memory_limit` is bytes of stash per rank, as measured; `device`: where
    to measure it, default where the factory builds it; `micro_batch_size`: the factory's
    micro-batches, see `load_factory`; `split_points`: the blocks where stages begin, instead
    of `partition`; `precision`: the run's `--precision` the stash bytes are priced at)."""
    default = CostModel()
    costs = costs or default
    if (costs.F, costs.B, costs.W) != (default.F, default.B, default.W):
        raise PipecError("--costs F/B/W come from the model; with MODEL give only comm=")
    v = family(schedule).default_v if v is None else v
    family_limit = None if evict or limit_in_bytes else memory_limit
    layout = build_schedule(schedule, Request(p, m, v, costs, family_limit)).layout
    model = model_plan(spec, layout, partition, profile, device, micro_batch_size, split_points)
    return compile_schedule(
        schedule,
        p,
        m,
        v,
        stashes_at(model_costs(model, costs.of_chunks(layout.stash_share)), precision),
        memory_limit,
        model=model,
        dp=dp,
        evict=evict,
        mapping=mapping,
        limit_in_bytes=limit_in_bytes,
        precision=precision,
    )


def model_plan(
    spec: str,
    layout: Layout,
    partition: str,
    profile: bool,
    device: str | None = None,
    micro_batch_size: int | None = None,
    split_points: tuple[str, ...] | None = None,
) -> dict:
    """The frontend's plan (JSON) of `spec` cut into the chunks `layout` places, with where the
    model comes from (`pipec.provenance.record`: a run checks it before training)."""
    from pipec.frontend import FrontendError, build_model_plan, load_factory  # torch: only here
    from pipec.provenance import record

    try:
        plan = build_model_plan(
            spec,
            layout.n_chunks,
            partition,
            profile,
            v=layout.n_chunks // layout.p,
            replicas=layout.n_stages // layout.n_chunks,
            device=device,
            micro_batch_size=micro_batch_size,
            split_points=split_points,
        )
        factory = record(spec, load_factory(spec, plan.seed, micro_batch_size).model)
    except FrontendError as e:
        raise PipecError(str(e)) from None
    return plan.to_json() | {"factory": factory}


def compile_model_torch_order(
    spec: str, torch_class: str, p: int, m: int, v: int | None = None, profile: bool = False
) -> CompileResult:
    """torch's own order for `torch_class` (e.g. ScheduleZBVZeroBubble) compiled for the model
    of `spec`: pipec's runtime then executes exactly the order torch's runtime does."""
    from pipec.passes.from_torch import schedule_from_torch
    from pipec.torch_orders import torch_order  # imports torch

    cls_name, rows, _ = torch_order(torch_class, p, m, v)
    source = f"torch's {cls_name} order (p={p}, m={m})"
    sched = schedule_from_torch(f"torch:{cls_name}", rows, source)
    model = model_plan(spec, sched.layout, "balanced", profile)
    return compile_from_schedule(sched, Options(model_costs(model, CostModel()), model=model))
