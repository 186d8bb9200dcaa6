"""The optimizer step of a training run: fp32 master weights, the global gradient norm and
clipping, the non-finite guard, the learning-rate schedule and ZeRO-1 sharding.

`Trainer` stands where a torch optimizer stood (OPTIMIZER_STEP calls its `step` once the
replica, tied and data-parallel sums are done). It steps a torch optimizer (AdamW or SGD) over
*master slices*: per parameter, the elements this rank steps, as a 1-D fp32 tensor.

- fp32, no ZeRO: a slice is the whole parameter, a view of it: the optimizer steps the
  parameter itself, exactly as `torch.optim.AdamW(model.parameters())` would.
- bf16 (runtime/precision.py): a slice is an fp32 copy (the master); its gradient is the
  parameter's fp32 `main_grad`; after the step the master is rounded into the bf16 parameter.
- ZeRO-1 (`zero`): the rank's parameters, laid end to end and padded to a multiple of D, are
  cut into D equal shards; copy d of the data-parallel group steps shard d only (masters and
  optimizer state are 1/D). Gradients are reduce-scattered over the group at the step (the
  data-parallel all-reduce of ALLREDUCE_GRADS is skipped), the shard is stepped, and the
  updated parameters are all-gathered in their own dtype.

Each step: the squared gradient norm of every chunk (each model parameter counted once: the
first pipeline's copy, a parameter tied across ranks on its lowest rank) and the count of
non-finite losses are summed over the ranks in one all-reduce; a non-finite loss or norm stops
the run before anything changes (`NonFinite`), or with `skip_nonfinite` skips the step. Else
gradients are scaled as `torch.nn.utils.clip_grad_norm_` would, the schedule's rate is set and
the optimizer steps. `step` returns the step's figures (`StepNumbers`), which OPTIMIZER_STEP
keeps in the rank's step state.

Without clipping or `skip_nonfinite` nothing the step does needs the other ranks' sums: the
all-reduce then runs while the rank steps, and is awaited with the step's figures
(`PendingStep`, read by runtime/metrics.py after the step): a waiting all-reduce in the step
cost the tiny GPT's last rank ~1 ms. A rank whose own sums are not finite does not step; when
the sum over the ranks is not, every rank raises `NonFinite` there, before the step's
checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipec.frontend.precision import PRECISIONS
from pipec.ir import PipecError
from pipec.runtime.lr import Schedule
from pipec.runtime.precision import grad_of

if TYPE_CHECKING:
    from pipec.runtime.rank import Rank

OPTIMIZERS = ("adamw", "sgd")
#: torch.optim's implementations of a step. foreach: one multi-tensor call per operation, the
#: numbers of torch's default step bit for bit (on CUDA it is the default; on CPU, whose
#: default is a loop over the parameters, the same numbers in 0.78x the time for the tiny GPT).
#: fused: one kernel for the whole update (torchtitan's default), 3-4x faster on CPU, rounding
#: differently (~1e-7 after 200 steps).
IMPLEMENTATIONS = ("foreach", "fused")


@dataclass(frozen=True)
class StepNumbers:
    """What one optimizer step used: its learning rate, the global gradient norm (before
    clipping) and whether it was skipped (a non-finite loss or norm under --skip-nonfinite)."""

    lr: float
    grad_norm: float
    skipped: bool


class PendingStep:
    """A step whose gradient norm is still being summed over the ranks: `result()` waits for
    the all-reduce and gives the step's `StepNumbers`, or raises `NonFinite`."""

    def __init__(self, trainer: Trainer, work: dist.Work, sums: Tensor, lr: float, step: int):
        self.trainer, self.work, self.sums, self.lr, self.step = trainer, work, sums, lr, step

    def result(self) -> StepNumbers:
        """Wait for the sum (once: runtime/step_state.py keeps what it gives)."""
        self.work.wait()
        norm, where = self.trainer.judge(self.sums.tolist())
        if where is not None:
            raise NonFinite(
                f"step {self.step}: {where}; stopped after the step, before its checkpoint (the "
                "last checkpoint untouched)"
            )
        return StepNumbers(self.lr, norm, False)


@dataclass(frozen=True)
class TrainOptions:
    """`launch.py`'s optimizer options (see runtime/options.py's `parse_launch`)."""

    schedule: Schedule
    optimizer: str = "adamw"
    implementation: str = "foreach"  # one of IMPLEMENTATIONS
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    precision: str = "fp32"
    max_norm: float | None = None
    zero: bool = False
    skip_nonfinite: bool = False


class NonFinite(RuntimeError):
    """A step's loss or gradient norm is not finite; raised on every rank alike, before the
    optimizer step."""


@dataclass(frozen=True)
class _Slice:
    """Elements [lo, hi) of a flattened parameter that this rank steps, and its master."""

    param: nn.Parameter
    lo: int
    hi: int
    master: Tensor


@dataclass(frozen=True)
class Held:
    """A parameter of this rank: its names in the model (a shared one has two), its chunk, where
    it starts in the rank's flat layout, whether it is the first pipeline's (a bidirectional
    schedule's second pipeline holds a replica) and whether the norm counts it here."""

    param: nn.Parameter
    names: tuple[str, ...]
    chunk: int
    offset: int
    first: bool
    counted: bool


def held_parameters(rt: Rank) -> list[Held]:
    """Every parameter of this rank once, in a layout every data-parallel copy shares."""
    layout, first = rt.layout, set(rt.layout.pipelines[0].stages)
    not_counted = {id(p) for p in _tied_elsewhere(rt)}
    seen: dict[int, tuple[nn.Parameter, list[str], int, bool]] = {}
    for s in sorted(rt.modules):
        for name, p in rt.modules[s].named_parameters(remove_duplicate=False):
            entry = seen.setdefault(id(p), (p, [], layout.stage_chunk[s], s in first))
            if name not in entry[1]:
                entry[1].append(name)
    out, offset = [], 0
    for pid, (p, names, chunk, in_first) in seen.items():
        counted = in_first and pid not in not_counted
        out.append(Held(p, tuple(names), chunk, offset, in_first, counted))
        offset += p.numel()
    return out


def _tied_elsewhere(rt: Rank) -> list[nn.Parameter]:
    """Parameters tied across ranks whose lowest holder (in the first pipeline) is another
    rank: the norm counts them there."""
    layout, out = rt.layout, []
    stages = layout.pipelines[0].stages
    for group in rt.build.plan["model"]["tied_parameters"]:
        names = {h["stage"]: h["name"] for h in group}
        holders = [s for s in stages if layout.stage_chunk[s] in names]
        if min(layout.stage_rank[s] for s in holders) == rt.rank:
            continue
        out += [
            rt.modules[s].get_parameter(names[layout.stage_chunk[s]])
            for s in holders
            if layout.stage_rank[s] == rt.rank
        ]
    return out


class Trainer:
    """This rank's optimizer (see the module doc); `step` and `zero_grad` as torch's."""

    def __init__(self, rt: Rank, options: TrainOptions) -> None:
        self.rt, self.options = rt, options
        self.bf16 = bf16 = options.precision == "bf16"
        if PRECISIONS[options.precision] is not rt.compute_dtype:
            raise PipecError(
                f"--precision {options.precision}: this rank's stages were captured for "
                f"{rt.compute_dtype or 'the model dtype'}; prepare the rank at the run's precision"
            )
        self.zero = options.zero  # the rank's data-parallel sum waits for the step (Rank.zero)
        self.held = held_parameters(rt)
        self.size = sum(h.param.numel() for h in self.held)
        d = rt.dp if options.zero else 1
        self.shard = -(-self.size // d)  # elements per copy; the last shard is padded
        self.start = lo = (rt.dp_index if options.zero else 0) * self.shard
        self._offset = {id(h.param): h.offset for h in self.held}
        chunk_of = {id(h.param): h.chunk for h in self.held if h.counted}  # in the norm
        self.slices: list[_Slice] = []
        for h in self.held:
            a, b = max(lo, h.offset), min(lo + self.shard, h.offset + h.param.numel())
            if a < b:
                flat = h.param.detach().view(-1)[a - h.offset : b - h.offset]
                master = flat.float().clone() if bf16 else flat
                self.slices.append(_Slice(h.param, a - h.offset, b - h.offset, master))
        if bf16:  # after the masters took the fp32 values
            rt.to_bf16()
        # Each slice's chunk in the norm (None: counted elsewhere), and those chunks as an index.
        self._slice_chunks = [chunk_of.get(id(s.param)) for s in self.slices]
        counted = [c for c in self._slice_chunks if c is not None]
        self._counted_chunks = torch.tensor(counted, dtype=torch.long, device=rt.device)
        self.skipped = 0
        self.norm_group = _pipeline_group(rt) if not options.zero else None
        self.inner = _optimizer(options, self.slices)

    def tensors(self) -> list[Tensor]:
        """The model state this object adds to the parameters: masters (bf16) and the
        optimizer's state tensors."""
        out = [s.master for s in self.slices] if self.bf16 else []
        return out + [
            t for st in self.inner.state.values() for t in st.values() if torch.is_tensor(t)
        ]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for h in self.held:
            h.param.grad = None
            if hasattr(h.param, "main_grad"):
                h.param.main_grad = None
        for s in self.slices:
            s.master.grad = None

    def step(self) -> StepNumbers | PendingStep:
        """Step the masters (see the module doc); the step's figures, pending while the gradient
        norm is summed over the ranks."""
        rt, opts = self.rt, self.options
        grads = self._shard_grads()
        sums = self._sums(grads)
        lr = opts.schedule.at(rt.step)
        alone = not (dist.is_initialized() and rt.world > 1)
        if not alone and opts.max_norm is None and not opts.skip_nonfinite:
            _, where = self.judge(sums.tolist())  # this rank's own sums
            work = dist.all_reduce(sums, group=self.norm_group, async_op=True)
            if where is None:
                self._take(grads, lr)
            else:
                self.zero_grad()
            return PendingStep(self, work, sums, lr, rt.step)
        if not alone:
            dist.all_reduce(sums, group=self.norm_group)
        norm, where = self.judge(sums.tolist())
        if where is not None:
            if not opts.skip_nonfinite:
                raise NonFinite(
                    f"step {rt.step}: {where}; stopped before the optimizer step (weights and "
                    "the last checkpoint untouched); --skip-nonfinite skips such steps instead"
                )
            self.skipped += 1
            self.zero_grad()
            return StepNumbers(lr, norm, True)
        if opts.max_norm is not None:
            coef = min(opts.max_norm / (norm + 1e-6), 1.0)
            torch._foreach_mul_([g for g in grads if g is not None], coef)
        self._take(grads, lr)
        return StepNumbers(lr, norm, False)

    def _take(self, grads: list[Tensor | None], lr: float) -> None:
        """Step the masters with `grads` at `lr`, bring the parameters up to date, zero."""
        for s, g in zip(self.slices, grads):
            s.master.grad = g
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        self._publish()
        self.zero_grad()

    # -- the step's parts -----------------------------------------------------------------

    def _shard_grads(self) -> list[Tensor | None]:
        """Each slice's fp32 gradient: a view of the parameter's, or (ZeRO) of this copy's
        shard of the reduce-scattered sum."""
        if not self.options.zero:  # every slice is a whole parameter
            return [None if (g := grad_of(s.param)) is None else g.view(-1) for s in self.slices]
        rt = self.rt
        flat = torch.zeros(self.shard * rt.dp, dtype=torch.float32, device=rt.device)
        for h in self.held:
            g = grad_of(h.param)
            if g is not None:
                flat[h.offset : h.offset + h.param.numel()] = g.view(-1)
        mine = torch.empty(self.shard, dtype=torch.float32, device=rt.device)
        dist.reduce_scatter_single(mine, flat, group=rt.groups.dp)
        return [mine[self.at(s) : self.at(s) + s.hi - s.lo] for s in self.slices]

    def at(self, s: _Slice) -> int:
        """Where slice `s` starts in this copy's shard (the whole layout without ZeRO)."""
        return self._offset[id(s.param)] + s.lo - self.start

    def _sums(self, grads: list[Tensor | None]) -> Tensor:
        """This rank's part of the step's sums: each chunk's squared gradient norm, then the
        number of non-finite losses."""
        rt = self.rt
        n = rt.layout.n_chunks
        sums = torch.zeros(n + 1, dtype=torch.float64, device=rt.device)
        found = [
            (g, c) for g, c in zip(grads, self._slice_chunks) if g is not None and c is not None
        ]
        if found:  # one call for every norm: a loop of vector_norm was ~1 ms of a tiny GPT step
            chunks = (  # made once, unless a counted slice has no gradient this step
                self._counted_chunks
                if len(found) == len(self._counted_chunks)
                else torch.tensor([c for _, c in found], device=rt.device)
            )
            norms = torch.stack(torch._foreach_norm([g for g, _ in found])).double()
            sums.index_add_(0, chunks, norms * norms)
        sums[n] = rt.loss_sums()[1]
        return sums

    def judge(self, values: list[float]) -> tuple[float, str | None]:
        """The gradient norm of `_sums`' values and, when it or a loss is not finite, what and
        where."""
        n = self.rt.layout.n_chunks
        norm = math.sqrt(sum(values[:n]))
        if values[n]:
            return norm, f"the loss is not finite (stage {n - 1}, the last)"
        if not math.isfinite(norm):
            bad = max(c for c in range(n) if not math.isfinite(values[c]))
            return norm, (
                f"the gradient norm is {norm}, first in stage {bad} (the backward's order)"
            )
        return norm, None

    def _publish(self) -> None:
        """Bring the parameters up to date with the stepped masters: round them into bf16
        parameters, and (ZeRO) all-gather every copy's shard."""
        rt = self.rt
        if not self.options.zero:
            if self.bf16:
                with torch.no_grad():
                    for s in self.slices:
                        s.param.view(-1)[s.lo : s.hi].copy_(s.master)
            return
        dtype = self.held[0].param.dtype
        mine = torch.zeros(self.shard, dtype=dtype, device=rt.device)
        for s in self.slices:
            mine[self.at(s) : self.at(s) + s.hi - s.lo] = s.master
        full = torch.empty(self.shard * rt.dp, dtype=dtype, device=rt.device)
        dist.all_gather_single(full, mine, group=rt.groups.dp)
        with torch.no_grad():
            for h in self.held:
                h.param.view(-1).copy_(full[h.offset : h.offset + h.param.numel()])


def _optimizer(options: TrainOptions, slices: list[_Slice]) -> torch.optim.Optimizer:
    """AdamW or SGD over the masters, in two groups: weight decay for parameters of two or more
    dimensions (matrices, embeddings), none for biases and norm weights."""
    decay = [s.master for s in slices if s.param.dim() >= 2]
    rest = [s.master for s in slices if s.param.dim() < 2]
    lr = options.schedule.lr
    groups = [
        {"params": decay, "weight_decay": options.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    how = {options.implementation: True}
    if options.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, **how)
    return torch.optim.AdamW(groups, lr=lr, betas=options.betas, eps=options.eps, **how)


def _pipeline_group(rt: Rank) -> object | None:
    """The ranks of this data-parallel copy's pipeline (every copy holds the same gradients
    after the all-reduce, so the norm sums over one copy); None: the whole world."""
    if rt.dp == 1:
        return None
    mine = None
    for d in range(rt.dp):  # every rank creates every group, in the same order
        group = dist.new_group([d * rt.P + r for r in range(rt.P)])
        if d == rt.dp_index:
            mine = group
    return mine
