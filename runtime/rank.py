"""One rank of a run: what is fixed for the run (the build, the program, the stages, the
device, communication, the optimizer) and, apart, what a step changes (runtime/step_state.py).

`Rank.prepare` does everything that needs no communication (read the build, check it fits the
run, rebuild this rank's stage modules from the model factory with the plan's seed and
partition), so a bad build is refused before any rank talks to another. `Rank.connect` then
creates the process groups the program's collectives use and the optimizer; the handlers in
compute.py, p2p.py, offload.py and grads.py do the rest. Only this module assigns a Rank's
fields: the others call its methods (`new_step`, `open_data`, `evaluating`).

Ranks: the build has P programs (pipeline ranks); with data parallelism D copies run side by
side and global rank = d·P + r for copy d, pipeline rank r.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipec.build_dir import Build, rank_file
from pipec.frontend import FrontendError, ModelSpec, build_stages, load_factory
from pipec.frontend.precision import BOUNDARY_DTYPES
from pipec.ir import Instr, Op, PipecError
from pipec.runtime.bwsplit import split_backward
from pipec.runtime.data import MicroBatch, Stream, Synthetic, open_source
from pipec.runtime.meter import Meter
from pipec.runtime.offload import size_moves
from pipec.runtime.p2p import SENDS, Comm, Links
from pipec.runtime.precision import to_bf16
from pipec.runtime.stash import storage_key
from pipec.runtime.step_state import StashBytes, StepState
from pipec.runtime.transport import Transport

if TYPE_CHECKING:
    from pipec.runtime.interpreter import Positions

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
P = TypeVar("P")

#: Line of instruction k in a .pipe file: a title line and a header line come first.
FIRST_INSTR_LINE = 3


def check_runnable(build: Build, world: int) -> None:
    """Raise PipecError unless `build` has a model and its P·D ranks are `world`."""
    plan, c = build.plan, build.compiled
    if plan.get("model") is None:
        raise PipecError(
            f"{build.path}: compiled without a model; recompile with "
            "`pipec compile MODEL ...` to run it"
        )
    dp = int(plan.get("dp", 1))
    if world != c.world * dp:
        raise PipecError(
            f"{build.path}: the plan has {c.world} pipeline ranks x {dp} data-parallel copies "
            f"= {c.world * dp} ranks, but this run has {world}; launch with "
            f"--nproc-per-node {c.world * dp}"
        )


@dataclass(frozen=True)
class Marks:
    """The (stage, mb) pairs this rank's program treats apart: forwards it recomputes (the
    stash keeps the inputs), stashes it EVICTs, and split stages' backwards run fused (BW)."""

    recomputed: frozenset[tuple[int, int]] = frozenset()
    evicted: frozenset[tuple[int, int]] = frozenset()
    fused: frozenset[tuple[int, int]] = frozenset()

    @staticmethod
    def of(program: tuple[Instr, ...]) -> Marks:
        split = any(i.op in (Op.B, Op.W) for i in program)
        return Marks(
            frozenset((i.stage, i.mb) for i in program if i.op is Op.RECOMPUTE),
            frozenset((i.stage, i.mb) for i in program if i.op is Op.EVICT),
            frozenset((i.stage, i.mb) for i in program if split and i.op is Op.BW),
        )


@dataclass(frozen=True)
class Groups:
    """The process groups of this rank's collectives (`Rank.connect`): its data-parallel group
    (None: one copy), one per replica pair and chunk by (peer, chunk), and a group per
    parameter tied across ranks with this rank's copy of it."""

    dp: object | None = None
    replicas: dict[tuple[int, int], object] = field(default_factory=dict)
    tied: tuple[tuple[object, nn.Parameter], ...] = ()


@dataclass
class Rank:
    """Everything one rank needs to execute its program; built by `prepare`, connected by
    `connect`. The fields are the run's; `step_state` is the step's, `stash_bytes` the stash
    counter's."""

    build: Build
    rank: int  # pipeline rank: index of the program
    dp_index: int
    device: torch.device
    program: tuple[Instr, ...]
    modules: dict[int, nn.Module]
    param_keys: dict[int, frozenset[int]]
    marks: Marks
    spec: ModelSpec  # loss_fn, the example micro-batch and the data
    meter: Meter  # real bytes (runtime/meter.py)
    data_seed: int = 0
    compute_dtype: torch.dtype | None = None  # bf16: the stages were captured at it (prepare)
    fp32_buffers: dict[str, Tensor] = field(default_factory=dict)  # saved in place of bf16 ones
    data: Synthetic | Stream | None = None  # opened by the first `batch` unless set
    comm: Comm | None = None
    optimizer: torch.optim.Optimizer | None = None
    groups: Groups = Groups()
    positions: Positions | None = None  # the program's per-step facts; made at the first step
    stash_bytes: StashBytes = field(default_factory=StashBytes)
    step_state: StepState = field(default_factory=StepState)

    @property
    def layout(self):
        return self.build.compiled.layout

    @property
    def P(self) -> int:
        return self.build.compiled.world

    @property
    def world(self) -> int:
        return self.P * self.dp

    @property
    def step(self) -> int:
        """The step being taken (1-based), for the learning-rate schedule."""
        return self.step_state.step

    @property
    def zero(self) -> bool:
        """ZeRO-1: the optimizer shards over the data-parallel copies, which then sum their
        gradients at the step (runtime/optim.py), not in ALLREDUCE_GRADS."""
        return bool(getattr(self.optimizer, "zero", False))

    @property
    def dp(self) -> int:
        return int(self.build.plan.get("dp", 1))

    @property
    def grank(self) -> int:
        return self.global_rank(self.rank)

    def global_rank(self, pipeline_rank: int) -> int:
        return self.dp_index * self.P + pipeline_rank

    @property
    def source(self) -> str:
        return rank_file(self.rank)

    @property
    def loss_scale(self) -> float:
        """Each micro-batch's loss weighs 1/(m·D): gradients are the global batch's mean."""
        return 1.0 / (self.layout.m * self.dp)

    def loss_sums(self) -> Tensor:
        """The step's recorded losses summed and how many are not finite, one float64 pair on
        the device. The losses stay there until the step's figures are read: an `.item()` per
        micro-batch made the host wait for the GPU after every last-stage F, so it could not
        queue the next instruction's kernels while that F ran."""
        losses = self.step_state.losses
        if not losses:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        values = torch.stack(list(losses.values())).double()
        return torch.stack((values.sum(), values.isfinite().logical_not().sum().double()))

    def describe(self, k: int | None) -> str:
        """'rank 2: F s=2 mb=3 (rank_002.pipe:17)', for fault messages."""
        where = f"rank {self.grank}"
        if k is None:
            return f"{where} (before its first instruction)"
        instr = self.program[k]
        text = f"{where}: {instr} ({self.source}:{k + FIRST_INSTR_LINE})"
        if self.comm is not None and self.comm.waiting_on:
            src, kind, stage, mb = self.comm.waiting_on
            text += f", waiting on rank {src} for {kind.name} s={stage} mb={mb}"
        elif instr.peer is not None:
            text += f", peer rank {self.global_rank(instr.peer)}"
        elif instr.op is Op.ALLREDUCE_GRADS:
            text += ", with its data-parallel group"
        return text

    def batch(self, mb: int) -> MicroBatch:
        """Inputs and target of this copy's micro-batch `mb` of this step, on this rank's device.

        The step's global batch is read at the first call of the step (`new_step` forgets the
        last one): only ranks holding a first or last stage ever read data.
        """
        batches = self.step_state.batches
        if not batches:
            m = self.layout.m
            if self.data is None:
                self.data = open_source(self.spec, m * self.dp, self.data_seed)
            mine = self.data.next()[self.dp_index * m : (self.dp_index + 1) * m]
            batches.update(
                (i, (tuple(self._input(x) for x in inputs), target.to(self.device)))
                for i, (inputs, target) in enumerate(mine)
            )
        return batches[mb]

    def _input(self, x: Tensor) -> Tensor:
        """A first stage's input on this rank's device, floating ones in the compute dtype."""
        if self.compute_dtype is not None and x.is_floating_point():
            return x.to(self.device, self.compute_dtype)
        return x.to(self.device)

    def open_data(self, data: Synthetic | Stream) -> None:
        """Read the training batches from `data` (a checkpoint's position in the stream)."""
        self.data = data

    def new_step(self, step: int) -> None:
        """Step `step` begins with a state of its own: nothing of the last step's is kept (its
        batch either: the next `batch` call reads the next one)."""
        self.step_state = StepState(step)

    def positions_for(self, make: Callable[[Rank], P]) -> P:
        """The program's per-step facts, made by `make` at its first step and kept."""
        if self.positions is None:
            self.positions = make(self)
        return self.positions

    @contextmanager
    def evaluating(self, program: tuple[Instr, ...], data: Stream) -> Iterator[None]:
        """Run `program` on `data` inside the block (runtime/evaluate.py), with positions and
        step state of its own; the training program, its data and its step state come back
        after, as they were."""
        saved = self.program, self.positions, self.data, self.step_state
        self.program, self.positions, self.data = program, None, data
        try:
            yield
        finally:
            self.program, self.positions, self.data, self.step_state = saved

    def to_bf16(self) -> None:
        """Train in bf16 from now on (runtime/precision.py): stages cast, fp32 `main_grad`s.
        The stages were captured at bf16 (`prepare(..., dtype=torch.bfloat16)`)."""
        self.fp32_buffers = to_bf16(self.modules.values())
        self.param_keys = {
            s: frozenset(storage_key(p) for p in m.parameters()) for s, m in self.modules.items()
        }

    def boundary(self, stage: int, which: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of what p2p receives for a stage: its `inputs` (activations, every
        dtype: hidden states, int64 ids, bool masks) or the gradients of its `outputs` (the
        floating ones only; integer and bool values have no gradient). The dtypes are the
        plan's, or, at bf16, those the stage was found to take and give at bf16 (build_stages)."""
        chunk = self.layout.stage_chunk[stage]
        facts = self.build.plan["model"]["stages"][chunk][which]
        at_run = getattr(self.modules[stage], "meta", {}).get(BOUNDARY_DTYPES)
        dtypes = at_run[which] if at_run else [getattr(torch, t["dtype"]) for t in facts]
        described = [(tuple(t["shape"]), d) for t, d in zip(facts, dtypes, strict=True)]
        if which == "inputs":
            return described
        return [(shape, dtype) for shape, dtype in described if dtype.is_floating_point]

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank holds, each once (stages on one rank may share one)."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules.values():
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """A stage's parameters in name order: replicas list theirs identically."""
        return [p for _, p in sorted(self.modules[stage].named_parameters())]

    # -- set-up -------------------------------------------------------------------------

    @staticmethod
    def prepare(
        build: Build,
        grank: int,
        world: int,
        device: torch.device,
        spec: str | None = None,
        data_seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> Rank:
        """Check that `build` fits a world of `world` ranks and rebuild this rank's stages
        (captured at `dtype` for a bf16 run; they hold the model's fp32 values until `to_bf16`).

        Raises PipecError (nothing has been communicated yet) when the build has no model,
        when the world size is not P·D, or when the model no longer matches the plan.
        """
        check_runnable(build, world)
        c, model_plan = build.compiled, build.plan["model"]
        rank, dp_index = grank % c.world, grank // c.world
        program = c.programs[rank]
        layout = c.layout
        try:
            # One build_stages call per pipeline (replica): stages of one replica on this rank
            # share tied parameters; the two replicas of a bidirectional schedule do not.
            modules: dict[int, nn.Module] = {}
            for pipeline in layout.pipelines:
                mine = [s for s in pipeline.stages if layout.stage_rank[s] == rank]
                if mine:
                    chunks = [layout.stage_chunk[s] for s in mine]
                    built = build_stages(spec, model_plan, chunks, device=device, dtype=dtype)
                    for s, module in zip(mine, built):
                        modules[s] = module.to(device)
            factory = load_factory(
                spec or model_plan["spec"], model_plan["seed"], model_plan.get("micro_batch_size")
            )
        except FrontendError as e:
            raise PipecError(str(e)) from None
        if any(i.op in (Op.B, Op.W) for i in program):
            for module in modules.values():
                split_backward(module)
        param_keys = {
            s: frozenset(storage_key(p) for p in m.parameters()) for s, m in modules.items()
        }
        marks = Marks.of(program)
        return Rank(
            build, rank, dp_index, device, program, modules, param_keys, marks, factory,
            Meter(device), data_seed, compute_dtype=dtype,
        )  # fmt: skip

    def connect(
        self, optimizer: OptimizerFactory, timeout: float, transport: Transport | None = None
    ) -> None:
        """Create the messages' transport (the backend's, unless given), the groups the
        program's collectives use (every rank, same order) and the optimizer, and measure a
        stash move's bytes where the plan's are not this run's (`size_moves`: a bf16 run's).
        Needs the default process group."""
        c = self.build.compiled
        transport = transport or Transport.for_run(dist.get_backend(), self.device)
        # Every rank of the world makes the links (dist.new_group's rule): none when the build
        # runs on part of it (a test driving pipec beside another runtime).
        whole = dist.get_world_size() == self.build.compiled.world * self.dp
        links = self._links() if transport.protocol == "gloo" and whole else None
        self.comm = Comm(
            self.global_rank,
            self.layout.n_stages,
            self.layout.m,
            timeout,
            self.device,
            transport,
            links=links,
        )
        dp_group = None
        dp_groups = [[d * c.world + r for d in range(self.dp)] for r in range(c.world)]
        for r, ranks in enumerate(dp_groups):
            group = dist.new_group(ranks) if self.dp > 1 else None
            if r == self.rank:
                dp_group = group
        # One group per replica pair and chunk: reductions of different chunks between the same
        # two ranks are then independent, whatever order the two programs issue them in.
        pairs = sorted(
            {
                (*sorted((r, i.peer)), self.layout.stage_chunk[i.stage])
                for r, prog in enumerate(c.programs)
                for i in prog
                if i.op is Op.ALLREDUCE_GRADS and i.peer is not None
            }
        )
        replicas = {}
        for d in range(self.dp):
            for a, b, chunk in pairs:
                group = dist.new_group([d * c.world + a, d * c.world + b])
                if d == self.dp_index and self.rank in (a, b):
                    replicas[(b if self.rank == a else a, chunk)] = group
        self.groups = Groups(dp_group, replicas, self._tied_groups())
        self.optimizer = optimizer(self.parameters())
        self.stash_bytes.moved = size_moves(self)  # after the optimizer: a bf16 run's at bf16

    def _links(self) -> Links:
        """A group per direction between two ranks that message each other (gloo: a pair of
        its own, so a send never waits on the other direction's receive; runtime/p2p.py),
        made by every rank in the same order."""
        c = self.build.compiled
        sends = {
            (r, i.peer)
            for r, prog in enumerate(c.programs)
            for i in prog
            if i.op in SENDS and i.peer != r
        }
        links = Links({}, {})
        for d in range(self.dp):
            for a, b in sorted(sends):
                src, dst = d * c.world + a, d * c.world + b
                group = dist.new_group(sorted((src, dst)))
                if src == self.grank:
                    links.send[dst] = group
                elif dst == self.grank:
                    links.recv[src] = group
        return links

    def _tied_groups(self) -> tuple[tuple[object, nn.Parameter], ...]:
        """Groups summing the gradients of parameters tied across ranks (embedding and head),
        each with this rank's copy of the parameter."""
        layout, c = self.layout, self.build.compiled
        tied = []
        for group in self.build.plan["model"]["tied_parameters"]:
            names = {h["stage"]: h["name"] for h in group}
            for pipeline in layout.pipelines:
                holders = [s for s in pipeline.stages if layout.stage_chunk[s] in names]
                ranks = sorted({layout.stage_rank[s] for s in holders})
                if len(ranks) < 2:
                    continue  # all holders on one rank share the parameter object
                for d in range(self.dp):
                    pg = dist.new_group([d * c.world + r for r in ranks])
                    mine = [s for s in holders if layout.stage_rank[s] == self.rank]
                    if d == self.dp_index and mine:
                        s = mine[0]
                        param = self.modules[s].get_parameter(names[layout.stage_chunk[s]])
                        tied.append((pg, param))
        return tuple(tied)
