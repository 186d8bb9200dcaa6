"""The frontend driver: factory → capture → partition → stage facts, and stage rebuilding.

Public entry points (re-exported by `pipec.frontend`):

- `build_model_plan(spec, n_stages, partition, profile)` → `ModelPlan` for the compiler.
- `split_model(spec, n_stages, partition)` → the stage `GraphModule`s, in order.
- `build_stages(spec, plan_json, stages)` → the given stages' modules, rebuilt by the runtime
  from the factory with the plan's seed and partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

import torch
from torch import fx

from pipec.frontend.blocks import Stacks, find_blocks, locate, refine
from pipec.frontend.boundaries import input_names, named_leaves, run_boundaries
from pipec.frontend.cost import Flops, count_flops
from pipec.frontend.facts import Costs, ModelPlan, StageFacts, TensorFacts, measure_stash_bytes
from pipec.frontend.partition import check_fits, resolve, split_point_counts
from pipec.frontend.precision import BOUNDARY_DTYPES, PRECISIONS, at_dtype, run_at, take_values
from pipec.frontend.spec import DEFAULT_SEED, FrontendError, ModelSpec, load_factory
from pipec.frontend.stages import keep_persistence, name_as_the_model, split
from pipec.frontend.trace import CaptureError, export, trace
from pipec.runtime.direct import direct_calls

# Converts counted FLOPs to seconds when not profiling: a round number of the order of one
# modern accelerator's sustained dense throughput. Only ratios matter to the scheduler.
DEFAULT_FLOPS_PER_S = 100e12

Partition = str | list[int]


@dataclass(frozen=True)
class _Traced:
    """A captured model with its blocks located."""

    spec: ModelSpec
    gm: fx.GraphModule
    capture: str  # "fx" or "export"
    stacks: Stacks
    block_of: dict[fx.Node, int]
    finer: _Traced | None = None  # the same graph cut one level down (`blocks.refine`)

    def stages(self, counts: list[int]) -> list[fx.GraphModule]:
        """The stages of `counts` blocks each (`stages.split`), `persistent`."""
        return self.persistent(split(self.gm, self.block_of, counts))

    def persistent(
        self, stages: list[fx.GraphModule], every: list[fx.GraphModule] | None = None
    ) -> list[fx.GraphModule]:
        """`stages` (of the chain `every`, by default themselves), each saving in its
        state_dict only what the model's own holds of it (a graph module registers every
        buffer it copies as persistent), under each name the model has for it."""
        model = self.spec.model.state_dict(keep_vars=True)
        persistent = model.keys()
        names: dict[int, list[str]] = {}  # the graph's tensors may be the model's or copies
        for state in (model, self.gm.state_dict(keep_vars=True)):
            for name, t in state.items():
                if name in persistent and name not in names.setdefault(id(t), []):
                    names[id(t)].append(name)
        held = {n for stage in every or stages for n in stage.state_dict()}
        for stage in stages:
            keep_persistence(stage, persistent)
            name_as_the_model(stage, names, held)
        return stages


def build_model_plan(
    spec: str | ModelSpec,
    n_stages: int,
    partition: Partition = "balanced",
    profile: bool = False,
    *,
    v: int = 1,
    replicas: int = 1,
    seed: int = DEFAULT_SEED,
    flops_per_s: float = DEFAULT_FLOPS_PER_S,
    runs: int = 5,
    progress: bool = True,
    device: str | None = None,
    micro_batch_size: int | None = None,
    split_points: Sequence[str] | None = None,
) -> ModelPlan:
    """Capture, partition and measure the model of `spec` for `n_stages` = p·v stages.

    partition: "balanced" (default), "uniform", "3,2,2,1" or [3, 2, 2, 1] (blocks per stage).
    split_points: block names where stages 1, 2, … begin (`layers.4`); they, or else the
        spec's `split_points`, take the place of `partition`.
    profile: time F, B, W of every stage on the local device (median of `runs`, progress bar
        on stderr unless `progress=False`) instead of converting counted FLOPs at
        `flops_per_s`. FLOPs are recorded either way.
    v: chunks per rank (n_stages must be a multiple); replicas: 1, or 2 for bidirectional
        schedules (recorded; `build_stages` is called once per replica).
    device: move the model there before anything is measured (`--device`; default: where the
        factory builds it).
    micro_batch_size: ask the factory for micro-batches of this size (recorded, so that
        `build_stages` asks again).
    Raises FrontendError with a one-line message for any problem with the model or arguments.
    """
    if n_stages < 1 or v < 1 or n_stages % v:
        raise FrontendError(f"n_stages={n_stages} must be a positive multiple of v={v} (S = p·v)")
    if replicas not in (1, 2):
        raise FrontendError(f"replicas={replicas}: use 1, or 2 for bidirectional schedules")
    traced = _trace(spec, seed, None, device, micro_batch_size, (n_stages, v))
    ms = traced.spec
    traced, mode, counts = _partition(traced, n_stages, partition, split_points, v)
    stages = traced.stages(counts)
    inputs, output = run_boundaries(stages, ms)
    loss = _last_loss(ms)
    starts = [sum(counts[:k]) for k in range(n_stages)]
    runnable = [direct_calls(st) for st in stages]  # as the runtime runs them
    stashes = [
        measure_stash_bytes(st, x, loss if k == n_stages - 1 else None)
        for k, (st, x) in enumerate(zip(runnable, inputs))
    ]
    stage_costs = count_flops(stages, inputs, starts, traced.stacks, loss)
    if profile:
        from pipec.frontend.profile import profile_stages  # imports the runtime package

        try:
            seconds = profile_stages(runnable, inputs, loss, runs=runs, progress=progress)
        except ValueError as e:
            raise FrontendError(f"cannot profile {_name(spec)}: {e}") from e
    else:
        seconds = [
            Costs(f.F / flops_per_s, f.B / flops_per_s, f.W / flops_per_s) for f in stage_costs
        ]
    facts = []
    for k, stage in enumerate(stages):
        if k + 1 < n_stages:
            out_names, out_values = input_names(stages[k + 1]), inputs[k + 1]
        else:
            out_names, out_values = named_leaves(output)
        params = list(stage.parameters())  # each shared tensor once
        facts.append(
            StageFacts(
                stage=k,
                blocks=(starts[k], starts[k] + counts[k]),
                inputs=tuple(TensorFacts.of(n, t) for n, t in zip(input_names(stage), inputs[k])),
                outputs=tuple(TensorFacts.of(n, t) for n, t in zip(out_names, out_values)),
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                stash_bytes=stashes[k],
                flops=Costs(stage_costs[k].F, stage_costs[k].B, stage_costs[k].W),
                seconds=seconds[k],
            )
        )
    return ModelPlan(
        spec=spec if isinstance(spec, str) else None,
        seed=seed,
        n_stages=n_stages,
        p=n_stages // v,
        v=v,
        replicas=replicas,
        blocks_path=traced.stacks.path,
        n_blocks=traced.stacks.n_blocks,
        partition_mode=mode,
        partition=tuple(counts),
        cost_source="profile" if profile else "estimate",
        flops_per_s=flops_per_s,
        device=str(ms.example_inputs[0].device),
        tied=_tied(stages),
        stages=tuple(facts),
        micro_batch_size=micro_batch_size,
        capture=traced.capture,
        stacks=traced.stacks.stacks,
        eval_data=ms.eval_data is not None,
    )


def split_model(
    spec: str | ModelSpec,
    n_stages: int,
    partition: Partition = "balanced",
    seed: int = DEFAULT_SEED,
    *,
    split_points: Sequence[str] | None = None,
) -> list[fx.GraphModule]:
    """The model's stages in order; chaining them computes exactly the unsplit forward."""
    traced = _trace(spec, seed, fits=(n_stages, 1))
    traced, _, counts = _partition(traced, n_stages, partition, split_points)
    return traced.stages(counts)


def build_stages(
    spec: str | None,
    plan_json: dict,
    stages: list[int],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    check_backward: bool = False,
) -> list[fx.GraphModule]:
    """Rebuild the factory with the plan's seed and partition; return `stages`' modules in order,
    as they are executed (`direct_calls`: the plan's stash bytes were measured on those).

    `spec` None uses the plan's own. `device`: move the model and its example there before
    capturing, so that the devices an exported graph names (`arange(..., device=...)`) are the
    run's. `dtype`: capture the model as it computes at that precision (bf16 runs; see
    pipec/frontend/precision.py), run the example through every stage at it (and, with
    `check_backward`, its backward), and note each stage's boundary dtypes at it in its
    `meta`; the modules hold the model's own values all the same.
    Raises FrontendError when the model no longer matches the plan (different blocks or
    parameter counts) or cannot compute at `dtype` (naming the op).
    """
    plan = ModelPlan.from_json(plan_json)
    spec = spec or plan.spec
    if spec is None:
        raise FrontendError("the plan was built from a ModelSpec object; pass the factory spec")
    captured = _trace(spec, plan.seed, plan.capture, device, plan.micro_batch_size, dtype=dtype)
    depths = (captured, captured.finer)
    traced = next((t for t in depths if t and t.stacks.stacks == plan.stacks), None)
    if traced is None:
        raise FrontendError(
            f"{spec} now has the blocks {captured.stacks.describe()}, the plan "
            f"{Stacks(plan.stacks).describe()}; recompile"
        )
    modules = split(traced.gm, traced.block_of, list(plan.partition))
    for k in stages:
        if not 0 <= k < plan.n_stages:
            raise FrontendError(f"stage {k} does not exist: the plan has {plan.n_stages} stages")
        params = sum(p.numel() for p in modules[k].parameters())
        if params != plan.stages[k].params:
            raise FrontendError(
                f"stage {k} of {spec} has {params} parameters, the plan {plan.stages[k].params};"
                " the model changed since compiling: recompile"
            )
    runnable = traced.persistent([direct_calls(modules[k]) for k in stages], modules)
    if dtype is not None:
        try:
            crossing = run_at(modules, traced.spec, dtype, backward=check_backward)
        except FrontendError as e:
            raise FrontendError(f"{_cannot_train(spec, dtype)}: {e}; {_AT_FP32}") from None
        for k, module in zip(stages, runnable):
            module.meta[BOUNDARY_DTYPES] = crossing[k]
        take_values(traced.gm, traced.spec.model)  # the stages share the graph's tensors
    return runnable


_AT_FP32 = "train it at fp32 (drop --precision)"


def _cannot_train(spec: str | ModelSpec, dtype: torch.dtype) -> str:
    precision = next(name for name, d in PRECISIONS.items() if d == dtype)
    return f"{_name(spec)} cannot train at --precision {precision}"


def _trace(
    spec: str | ModelSpec,
    seed: int,
    capture: str | None = None,
    device: torch.device | str | None = None,
    micro_batch_size: int | None = None,
    fits: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
) -> _Traced:
    """Capture the model (`capture`, else the spec's choice) and locate its blocks; with
    `device`, first move the model and its example batch there (`--device`, or a rank's own).
    `fits` (n_stages, v): refuse before capturing when the module tree holds fewer blocks
    than stages (capture only drops stacks, so the count before it is an upper bound).
    `dtype`: capture a copy cast to it; the graph holds the cast values (`take_values` gives it
    the model's own).
    """
    if isinstance(spec, str):
        ms = load_factory(spec, seed, micro_batch_size)
    elif micro_batch_size is not None:
        raise FrontendError("micro_batch_size asks a factory: pass its spec, not a ModelSpec")
    else:
        ms = spec
    if device is not None:
        from pipec.frontend.profile import on_device  # imports the runtime package

        ms = on_device(ms, str(device))
    method = capture or ms.capture
    stacks = find_blocks(ms.model)
    if fits is not None:  # the most blocks the model may be cut into, one level down included
        check_fits(refine(ms.model, stacks) or stacks, *fits)
    try:
        gm, method = _capture(ms if dtype is None else at_dtype(ms, dtype), method)
    except CaptureError as e:
        if dtype is None:
            raise
        raise FrontendError(f"{_cannot_train(spec, dtype)}: {e.problem}; {_AT_FP32}") from None
    ran, block_of = locate(gm, stacks)
    traced = _Traced(ms, gm, method, ran, block_of)
    inner = refine(ms.model, ran)
    if inner is None:
        return traced
    try:
        finer = _Traced(ms, gm, method, *locate(gm, inner))
    except FrontendError:  # an inner block that never runs: the outer blocks are the cuts
        return traced
    return replace(traced, finer=finer)


def _capture(ms: ModelSpec, method: str) -> tuple[fx.GraphModule, str]:
    """The model's graph and how it was captured: "auto" takes torch.export's, and torch.fx's
    only when export fails (then, when fx fails too, export's error is the one reported)."""
    if method == "fx":
        return trace(ms), "fx"
    try:
        return export(ms), "export"
    except FrontendError as export_error:
        if method == "export":
            raise
        try:
            return trace(ms), "fx"
        except FrontendError:
            raise export_error from None


def _partition(
    traced: _Traced,
    n_stages: int,
    partition: Partition,
    split_points: Sequence[str] | None,
    v: int = 1,
) -> tuple[_Traced, str, list[int]]:
    """The blocks to cut along (`traced`, or its `finer` blocks one level down), the mode and
    the blocks per stage: from split points if given (argument, else spec), naming blocks at
    either level, else from `partition`. One level down when the outer blocks are too few for
    `n_stages`, and for "balanced" when it lowers the costliest stage by more than
    `FINER_GAIN` (block costs are counted only for "balanced")."""
    points = split_points if split_points is not None else traced.spec.split_points
    finer = traced.finer
    if points is not None:
        outer = set(traced.stacks.names())
        named = all(any(n == p or n.endswith("." + p) for n in outer) for p in points)
        at = traced if named or finer is None else finer
        return at, "explicit", split_point_counts(points, at.stacks, n_stages)
    if finer is not None and n_stages > traced.stacks.n_blocks:
        traced, finer = finer, None
    check_fits(traced.stacks, n_stages, v)
    if partition != "balanced":
        return traced, *resolve(partition, [0] * traced.stacks.n_blocks, n_stages)
    costs = [f.total for f in _block_flops(traced)]
    mode, counts = resolve(partition, costs, n_stages)
    if finer is not None:
        finer_costs = [f.total for f in _block_flops(finer)]
        _, finer_counts = resolve(partition, finer_costs, n_stages)
        if _costliest(finer_costs, finer_counts) < (1 - FINER_GAIN) * _costliest(costs, counts):
            return finer, mode, finer_counts
    return traced, mode, counts


#: How much lower the costliest stage must be for "balanced" to cut inside outer blocks: the
#: outer blocks are the model's own units (a Swin stage), so they stay whole unless cutting
#: inside them helps much (Swin's 2, 2, 6, 2 layers at p=4: the costliest stage 49% -> 26%).
FINER_GAIN = 0.1


def _costliest(costs: list[int], counts: list[int]) -> int:
    bounds = [sum(counts[:k]) for k in range(len(counts) + 1)]
    return max(sum(costs[a:b]) for a, b in pairwise(bounds))


def _block_flops(traced: _Traced) -> list[Flops]:
    """FLOPs per block: each block cut as a stage of its own and counted; what comes before
    the first block and after the last (embedding, head, loss) counts with them."""
    n = traced.stacks.n_blocks
    blocks = traced.stages([1] * n)
    inputs, _ = run_boundaries(blocks, traced.spec)
    loss = _last_loss(traced.spec)
    return count_flops(blocks, inputs, list(range(n)), traced.stacks, loss)


def _name(spec: str | ModelSpec) -> str:
    return spec if isinstance(spec, str) else type(spec.model).__name__


def _last_loss(ms: ModelSpec):  # type: ignore[no-untyped-def]
    """The last stage's tail: output -> loss on the example target."""
    return lambda out: ms.loss_fn(out, ms.example_target)


def _tied(stages: list[fx.GraphModule]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Parameters held by more than one stage, as ((stage, name), …) groups."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            holders.setdefault(id(p), []).append((k, name))
    return tuple(tuple(h) for h in holders.values() if len({k for k, _ in h}) > 1)
