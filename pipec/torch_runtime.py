"""pipec's schedules on torch's pipelining runtime, beside FSDP2 and tensor parallelism.

pipec does not shard parameters or split layers itself: `stage_modules` cuts the user's own
model at a build's block boundaries into the stages one pipeline rank holds (in the build's
placement, looped or V), each a module whose parameters keep the model's names, so that
`fully_shard` per block and `parallelize_module` plans such as
`{"layers.*.attention.wq": ColwiseParallel()}` apply to it as to the whole model (per-block
units only when the build keeps each backward whole: see `splits_backward`); `schedule`
returns torch's `_PipelineScheduleRuntime` running the build's exact order over those stages
(wrapped in `PipelineStage`s on the mesh's pipeline group).

A stage is a shallow copy of the model: the blocks of the stage are the model's own modules (no
copy of their weights), the blocks of other stages are left out, and the modules holding
parameters outside the blocks are kept on the stage that computes them (those registered
before the blocks on the first stage, those after on the last) and replaced by `nn.Identity`
elsewhere. A later stage therefore runs the model's own forward on the residual stream it
receives; a stage that is not the last returns the output of its last block, the last stage
the tensors of the model's output (whose structure, such as a Hugging Face `ModelOutput`,
`schedule` rebuilds for the loss function). A model whose code outside its blocks does more
than modules in a row (say, adds position embeddings to the token embeddings) cannot be cut
this way: the first block of a later stage would not receive the stage's input, and the stage
says so at its first forward rather than compute something else. Tied parameters across
stages are refused: torch's `PipelineStage` keeps no tie.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from pipec.build_dir import Build, load
from pipec.frontend.blocks import Stacks, find_blocks
from pipec.frontend.facts import ModelPlan
from pipec.ir import PipecError
from pipec.passes.to_torch import torch_rows

Loss = Callable[[Any, Tensor], Tensor]


def torch_build(build_dir: Path | str) -> Build:
    """The build, if torch's runtime can run it; else PipecError saying to use `pipec run`."""
    build = load(Path(build_dir))
    family = build.plan["schedule"]
    try:
        torch_rows(build.compiled, comms=False)
    except PipecError as e:
        raise PipecError(
            f"{build_dir}: torch's runtime cannot run {family} ({e}); train it with "
            f"`pipec run {build_dir}`"
        ) from None
    if build.plan.get("model") is None:
        raise PipecError(
            f"{build_dir}: compiled without a model; compile with `pipec compile MODEL ...`"
        )
    return build


def stage_modules(build_dir: Path | str, model: nn.Module, pp_rank: int) -> dict[int, nn.Module]:
    """This pipeline rank's stages of `model` (stage index -> module), cut as the build cuts.

    The model must be the one the build was compiled from (same blocks, same parameter count in
    every stage), else PipecError. The stages share the model's block modules: apply FSDP or TP
    to the stages, not to the model.
    """
    build = torch_build(build_dir)
    plan = ModelPlan.from_json(build.plan["model"])
    layout = build.compiled.layout
    if not 0 <= pp_rank < layout.p:
        raise PipecError(f"pp_rank {pp_rank}: {build_dir} has pipeline ranks 0..{layout.p - 1}")
    if plan.tied:
        names = ", ".join(f"stage {k} {name}" for k, name in plan.tied[0])
        raise PipecError(
            f"{build_dir}: tied parameters span stages ({names}); torch's PipelineStage keeps "
            "no tie between stages: untie them (e.g. tie_word_embeddings=False) and recompile"
        )
    if len(plan.stacks) > 1:
        raise PipecError(
            f"{build_dir}: cut along several stacks of blocks ({Stacks(plan.stacks).describe()}); "
            "torch's engine path cuts one stack: run this build with `pipec run`"
        )
    found = find_blocks(model)
    if dict(found.stacks).get(plan.blocks_path) != plan.n_blocks:
        raise PipecError(
            f"{type(model).__name__} has the blocks {found.describe() or 'none'}, the build "
            f"{build_dir} {plan.n_blocks} in {plan.blocks_path!r}: pass the model the build was "
            "compiled from, or recompile for this one"
        )
    mine = [s for s in range(layout.n_stages) if layout.stage_rank[s] == pp_rank]
    out = {}
    for s in mine:
        first = sum(plan.partition[:s])
        module = _cut(model, plan, s, range(first, first + plan.partition[s]))
        params = sum(p.numel() for p in module.parameters())
        if params != plan.stages[s].params:
            raise PipecError(
                f"stage {s} of {type(model).__name__} has {params} parameters, the build "
                f"{build_dir} {plan.stages[s].params}: pass the model the build was compiled "
                "from, or recompile for this one"
            )
        out[s] = module
    return out


def pipeline_stages(
    build_dir: Path | str, modules: dict[int, nn.Module], device: Any, group: Any = None
) -> list[Any]:
    """torch's `PipelineStage` for each of `stage_modules`' modules (after FSDP/TP), in stage
    order, on the pipeline process `group` (a mesh's `mesh["pp"].get_group()`)."""
    from torch.distributed.pipelining import PipelineStage

    n = torch_build(build_dir).compiled.layout.n_stages
    return [PipelineStage(modules[s], s, n, device, group=group) for s in sorted(modules)]


def schedule(build_dir: Path | str, stages: Sequence[Any], loss_fn: Loss) -> Any:
    """torch's `_PipelineScheduleRuntime` over `stages` (this rank's `PipelineStage`s, built on
    `stage_modules`' modules), loaded with the build's order (compute_only: torch adds the
    sends, receives, FSDP unshard/reshard and gradient reduction). Gradients are averaged over
    the m micro-batches (`scale_grads`), as for a loss that averages."""
    from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

    build = torch_build(build_dir)
    layout = build.compiled.layout
    if not stages:
        raise PipecError(f"no stages given; build them from stage_modules({build_dir}, ...)")
    size = stages[0].group_size
    if size != layout.p:
        raise PipecError(
            f"the pipeline group has {size} ranks, {build_dir} is a {layout.p}-rank pipeline: "
            f"make the mesh's pp dimension {layout.p}"
        )
    rank = stages[0].group_rank
    want = sorted(s for s in range(layout.n_stages) if layout.stage_rank[s] == rank)
    got = sorted(st.stage_index for st in stages)
    if got != want or any(st.num_stages != layout.n_stages for st in stages):
        raise PipecError(
            f"pipeline rank {rank} holds stages {want} of {layout.n_stages} in {build_dir}, "
            f"given {got}: build them from stage_modules({build_dir}, model, {rank})"
        )
    last = next((st.submod for st in stages if st.is_last), None)
    rebuild = getattr(last, "_pipec_rebuild", None)
    if rebuild is not None:
        given = loss_fn

        def loss_fn(out: Any, target: Tensor) -> Tensor:
            return given(rebuild(out), target)

    rows = torch_rows(build.compiled, comms=False)
    if _splits(rows) and any(_nested_fsdp(st.submod) for st in stages):
        raise PipecError(
            f"{build.plan['schedule']} splits the backward (I/W) and a stage holds FSDP units "
            "inside it: torch's runtime then loses weight gradients; fully_shard each stage as "
            "one unit (see splits_backward)"
        )
    runtime = _PipelineScheduleRuntime(list(stages), layout.m, loss_fn=loss_fn)
    runtime.pipeline_order = {
        r: [_Action.from_str(str(a)) for cell in row for a in cell] for r, row in enumerate(rows)
    }
    runtime._prepare_schedule_with_comms(runtime.pipeline_order)
    return runtime


def splits_backward(build_dir: Path | str) -> bool:
    """Whether the build runs input and weight backwards apart (torch's I and W): then FSDP2
    must shard each stage as one unit, not block by block (measured on torch 2.13: per-block
    units inside a stage lose weight gradients under I/W, whole-stage units do not)."""
    return _splits(torch_rows(torch_build(build_dir).compiled, comms=False))


def _splits(rows: list[list[tuple[Any, ...]]]) -> bool:
    return any(a.type in ("I", "W") for row in rows for cell in row for a in cell)


def _nested_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules() if m is not module)


class _Stage:
    """What one stage's forward checks and returns (see `_cut`)."""

    def __init__(self, model: str, first: bool, last: bool, blocks: str) -> None:
        self.model, self.first, self.last, self.blocks = model, first, last, blocks
        self.input: Tensor | None = None
        self.entered = False  # the first block began
        self.running = False  # the hooks sit on the model's own blocks: act only in the stage
        self.output: Tensor | None = None
        self.spec: TreeSpec | None = None
        self.leaves: list[Any] = []

    def check_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A later stage's first block must receive the stage's input itself."""
        if not self.running:
            return
        self.entered = True
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        if not _same(x, self.input):
            raise PipecError(self.outside())

    def outside(self) -> str:
        return (
            f"{self.model} computes more than modules in a row before {self.blocks}: a later "
            "stage's first block would not receive the stage's input as is, so the model "
            "cannot be cut into stages of its own modules; move that code into a module"
        )

    def keep_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.running:
            self.output = output

    def tensors(self, out: Any) -> Any:
        """The last stage's output as torch's stages need it (a tensor or a tuple of them);
        `rebuild` turns them back into the model's own structure for the loss function."""
        if isinstance(out, Tensor):
            return out
        leaves, self.spec = tree_flatten(out)
        self.leaves = leaves
        return tuple(x for x in leaves if isinstance(x, Tensor))

    def rebuild(self, out: Any) -> Any:
        if self.spec is None:
            return out
        given = iter(out if isinstance(out, tuple) else (out,))
        leaves = [next(given) if isinstance(x, Tensor) else x for x in self.leaves]
        return tree_unflatten(leaves, self.spec)


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    """The same values: one tensor, or a view with the same storage, offset and layout."""
    if a is None or b is None:
        return False
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    )


def _cut(model: nn.Module, plan: ModelPlan, s: int, blocks: range) -> nn.Module:
    """Stage `s` of `model`: a shallow copy keeping `blocks` and its own outer modules."""
    first, last = s == 0, s == plan.n_stages - 1
    path = plan.blocks_path.split(".") if plan.blocks_path else []
    stage = _copy_along(model, path, first, last, blocks)
    kept = [_block(stage, plan.blocks_path, str(b)) for b in blocks]
    state = _Stage(type(model).__name__, first, last, plan.blocks_path or "its blocks")
    kept[-1].register_forward_hook(state.keep_output)
    if not first:
        kept[0].register_forward_pre_hook(state.check_input, with_kwargs=True)
    model_forward = stage.forward
    extra = (
        {"use_cache": False} if "use_cache" in inspect.signature(model_forward).parameters else {}
    )

    def forward(*args: Any, **kwargs: Any) -> Any:
        state.input, state.entered = next((a for a in args if isinstance(a, Tensor)), None), False
        state.running = True
        try:
            out = model_forward(*args, **(extra | kwargs))
        except Exception as e:
            if first or state.entered:
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise PipecError(f"{state.outside()} ({reason})") from e
        finally:
            state.running = False
        return state.tensors(out) if last else state.output

    stage.forward = forward  # type: ignore[method-assign]
    stage._pipec_rebuild = state.rebuild  # the loss sees the model's own output
    return stage


def _block(stage: nn.Module, blocks_path: str, index: str) -> nn.Module:
    container = stage.get_submodule(blocks_path) if blocks_path else stage
    return container._modules[index]  # type: ignore[return-value]


def _copy_along(
    module: nn.Module, path: list[str], first: bool, last: bool, blocks: range
) -> nn.Module:
    """A shallow copy of `module` (own dictionaries: hooks and children are its own) whose
    children along `path` are copied in turn, the block container keeping only `blocks`;
    children beside the path that hold parameters stay only on the stage computing them."""
    copied = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict):
            copied.__dict__[key] = copy.copy(value)
    if not path:
        copied._modules = {str(b): module._modules[str(b)] for b in blocks}
        return copied
    on_path = list(module._modules).index(path[0])
    for k, (name, child) in enumerate(module._modules.items()):
        if name == path[0]:
            copied._modules[name] = _copy_along(child, path[1:], first, last, blocks)
        elif _holds_parameters(child) and not (first if k < on_path else last):
            copied._modules[name] = nn.Identity()
    return copied


def outer_modules(model: nn.Module, blocks_path: str) -> tuple[list[str], list[str]]:
    """The names of the modules holding parameters outside the blocks at `blocks_path`, as
    `stage_modules` places them: those registered before the blocks (the first stage's) and
    those after (the last stage's), each in the order the forward runs them."""
    before: list[str] = []
    after: list[str] = []
    module, prefix = model, ""
    for part in blocks_path.split(".") if blocks_path else ():
        names = [n for n, child in module._modules.items() if n == part or _holds_parameters(child)]
        here = names.index(part)
        before += [prefix + n for n in names[:here]]
        after = [prefix + n for n in names[here + 1 :]] + after  # an inner module runs first
        module, prefix = module._modules[part], f"{prefix}{part}."
    return before, after


def _holds_parameters(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())
