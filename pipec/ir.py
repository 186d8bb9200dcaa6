"""The IR every pipec package shares: instructions, rank programs, the layout and the work graph.

A schedule decides, per rank, the order of compute ops; lowering turns that into a `Program`
per rank (compute plus communication); codegen prints programs; the runtime executes them.
Everything here is a frozen value so results compare with `==` (golden tests, round-trips).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

FORMAT_VERSION = 1


class PipecError(ValueError):
    """Bad user input or an infeasible request; the CLI prints the message and exits 2."""


class Op(enum.Enum):
    """What one instruction does at run time (the runtime's dispatch table is keyed on this)."""

    F = "F"
    """Run the forward of (stage, mb) and keep its stash for the backward."""
    B = "B"
    """Input-gradient backward of (stage, mb); weight-gradient work is queued for `W`."""
    W = "W"
    """Weight-gradient backward of (stage, mb): run the queued GEMMs, free what is left."""
    BW = "BW"
    """Fused backward of (stage, mb): input and weight gradients at once, stash freed."""
    RECOMPUTE = "RECOMPUTE"
    """Re-run the forward of (stage, mb) from its stashed input to rebuild the full stash."""
    SEND_ACT = "SEND_ACT"
    """Send the output activation of (stage, mb) to `peer` (non-blocking)."""
    RECV_ACT = "RECV_ACT"
    """Post the receive of the input activation of (stage, mb) from `peer`."""
    SEND_GRAD = "SEND_GRAD"
    """Send the input gradient of (stage, mb) to `peer` (non-blocking)."""
    RECV_GRAD = "RECV_GRAD"
    """Post the receive of the output gradient of (stage, mb) from `peer`."""
    EVICT = "EVICT"
    """Send the stash of (stage, mb) to the acceptor `peer` and free it here."""
    LOAD = "LOAD"
    """Post the receive of the stash of (stage, mb) that the acceptor `peer` RETURNs, ahead of
    its backward (a prefetch); the first op that reads the stash waits for it to arrive."""
    ACCEPT = "ACCEPT"
    """Receive and hold the stash of (stage, mb) evicted by `peer`."""
    RETURN = "RETURN"
    """Send the held stash of (stage, mb) back to the evictor `peer` and free it here."""
    ALLREDUCE_GRADS = "ALLREDUCE_GRADS"
    """All-reduce the gradients of `stage` with its replica on `peer` (or the DP group).

    Roughly: issue the collective (asynchronously) once the stage's last backward is done;
    OPTIMIZER_STEP waits for it. Both ranks of a replica pair issue their pair's collectives in
    the same order, so even a blocking collective cannot deadlock.
    """
    OVERLAP = "OVERLAP"
    """The next two compute instructions, a forward and a backward, form DualPipe's F&B pair.

    Roughly: nothing. The pair is not overlapped: pipec's runtime runs the forward, then the
    backward, each once its own input has arrived, and the simulator times them the same way
    (passes/simulate.py). A runtime that overlaps them could read it as a hint.
    """
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    """Apply the optimizer to every parameter this rank holds, then zero the gradients."""

    # Members are singletons: identity hashing is correct and, unlike Enum's Python-level
    # __hash__, runs in C. Work-graph nodes are hashed millions of times at p=64, m=1024.
    __hash__ = object.__hash__


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.W, Op.BW, Op.RECOMPUTE})
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})
#: BPipe's stash moves: EVICT/ACCEPT and RETURN/LOAD are matched pairs between two ranks.
MEMORY_OPS = frozenset({Op.EVICT, Op.LOAD, Op.ACCEPT, Op.RETURN})
#: Ops whose peer field is the destination (printed `to=`); the others print `from=`.
TO_PEER_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD, Op.EVICT, Op.RETURN, Op.ALLREDUCE_GRADS})
#: Tensors one message (a stage boundary) carries at most: the runtime gives each its own tag,
#: and the frontend refuses a cut with more.
MAX_TENSORS = 8
_OP_NAME = {op: op.value for op in Op}  # Enum's .value is a slow descriptor on hot paths
_PEER_KEY = {op: " to=" if op in TO_PEER_OPS else " from=" for op in Op}


@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of a rank's program; fields that an op does not use stay None."""

    op: Op
    stage: int | None = None
    mb: int | None = None
    peer: int | None = None

    def __init__(
        self, op: Op, stage: int | None = None, mb: int | None = None, peer: int | None = None
    ) -> None:
        # Written out (dataclass keeps it): the generated frozen __init__ goes through
        # object.__setattr__, twice as slow, and a compile makes 10^5-10^6 instructions.
        _set_op(self, op)
        _set_stage(self, stage)
        _set_mb(self, mb)
        _set_peer(self, peer)

    def __str__(self) -> str:
        stage, mb, peer = self.stage, self.mb, self.peer
        if stage is not None and mb is not None:  # nearly every instruction: one format
            if peer is None:
                return f"{_OP_NAME[self.op]} s={stage} mb={mb}"
            return f"{_OP_NAME[self.op]} s={stage} mb={mb}{_PEER_KEY[self.op]}{peer}"
        text = _OP_NAME[self.op]
        if self.stage is not None:
            text += f" s={self.stage}"
        if self.mb is not None:
            text += f" mb={self.mb}"
        if self.peer is not None:
            text += f" {'to' if self.op in TO_PEER_OPS else 'from'}={self.peer}"
        return text


_set_op, _set_stage, _set_mb, _set_peer = (
    Instr.__dict__[field].__set__ for field in ("op", "stage", "mb", "peer")
)  # the slots' own setters: they skip the frozen class's __setattr__

Program = tuple[Instr, ...]
"""One rank's instructions, in the order the runtime executes them."""


@dataclass(frozen=True)
class Pipeline:
    """One direction of data flow: the stages a micro-batch visits, and which micro-batches."""

    stages: tuple[int, ...]
    mbs: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Where stages live and how micro-batches flow through them.

    `stage_rank[s]` is the rank that holds stage s; `stage_chunk[s]` is the model chunk it
    computes (two replicas of a chunk are two stages with the same chunk). A stage's stash of
    one micro-batch weighs `p / n_chunks` in units of one rank's full share of the model.
    """

    p: int
    stage_rank: tuple[int, ...]
    stage_chunk: tuple[int, ...]
    pipelines: tuple[Pipeline, ...]

    @property
    def n_stages(self) -> int:
        return len(self.stage_rank)

    @cached_property
    def n_chunks(self) -> int:
        return len(set(self.stage_chunk))

    @cached_property
    def m(self) -> int:
        return sum(len(pl.mbs) for pl in self.pipelines)

    @cached_property
    def stash_share(self) -> float:
        """One micro-batch's stash of one stage, in units of one rank's full share."""
        return self.p / self.n_chunks

    @cached_property
    def _neighbours(self) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        nxt: dict[int, int] = {}
        prv: dict[int, int] = {}
        pipe_of_stage: dict[int, int] = {}
        for i, pl in enumerate(self.pipelines):
            for a, b in zip(pl.stages, pl.stages[1:]):
                nxt[a], prv[b] = b, a
            for s in pl.stages:
                pipe_of_stage[s] = i
        return nxt, prv, pipe_of_stage

    def next_stage(self, stage: int) -> int | None:
        """The stage after `stage` in its pipeline, or None for the last stage (the loss)."""
        return self._neighbours[0].get(stage)

    def prev_stage(self, stage: int) -> int | None:
        """The stage before `stage` in its pipeline, or None for the first stage."""
        return self._neighbours[1].get(stage)

    def pipeline_of_stage(self, stage: int) -> int:
        return self._neighbours[2][stage]

    @cached_property
    def pipeline_of_mb(self) -> dict[int, int]:
        return {mb: i for i, pl in enumerate(self.pipelines) for mb in pl.mbs}

    @cached_property
    def _dependency_tables(self) -> dict[bool, dict[Op, list[tuple[Pred, ...]]]]:
        """`dependency_table`'s answers, one per `recompute`."""
        return {}

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)

    @cached_property
    def replica(self) -> dict[int, int]:
        """stage -> the other stage computing the same chunk (bidirectional schedules hold two
        replicas of the model); stages of a chunk held once are absent."""
        by_chunk: dict[int, list[int]] = {}
        for s, c in enumerate(self.stage_chunk):
            by_chunk.setdefault(c, []).append(s)
        return {a: b for pair in by_chunk.values() if len(pair) == 2 for a, b in (pair, pair[::-1])}

    def params_of_rank(self, rank: int) -> float:
        """Parameter memory a rank holds, in units of one rank's share of one model copy."""
        return len(self.stages_of_rank(rank)) * self.stash_share

    def to_json(self) -> dict:
        return {
            "p": self.p,
            "stage_rank": list(self.stage_rank),
            "stage_chunk": list(self.stage_chunk),
            "pipelines": [
                {"stages": list(pl.stages), "mbs": list(pl.mbs)} for pl in self.pipelines
            ],
        }

    @staticmethod
    def from_json(d: dict) -> Layout:
        return Layout(
            p=int(d["p"]),
            stage_rank=tuple(d["stage_rank"]),
            stage_chunk=tuple(d["stage_chunk"]),
            pipelines=tuple(
                Pipeline(tuple(pl["stages"]), tuple(pl["mbs"])) for pl in d["pipelines"]
            ),
        )


def single_pipeline(p: int, m: int, stage_rank: tuple[int, ...]) -> Layout:
    """The layout of every one-direction schedule: stages 0..S-1 in order, all micro-batches."""
    n = len(stage_rank)
    return Layout(p, stage_rank, tuple(range(n)), (Pipeline(tuple(range(n)), tuple(range(m))),))


@dataclass(frozen=True)
class Schedule:
    """A schedule family's decision: the layout and each rank's order of compute ops."""

    name: str
    p: int
    m: int
    v: int
    layout: Layout
    orders: tuple[Program, ...]


@dataclass(frozen=True)
class Compiled:
    """What the compiler emits: the schedule's identity, its layout and one program per rank."""

    schedule: str
    p: int
    m: int
    v: int
    layout: Layout
    programs: tuple[Program, ...]

    @property
    def world(self) -> int:
        return len(self.programs)


def instruction_count(compiled: Compiled) -> int:
    """How many instructions the programs hold: the size of every pass's work."""
    return sum(map(len, compiled.programs))


_KINDS_SEEN: dict[int, tuple[object, frozenset[Op]]] = {}


def op_kinds(programs: Sequence[Sequence[Instr]]) -> frozenset[Op]:
    """Every op the programs use.

    Each pass asks this (recompute? fused backwards?) of the same 10^5-10^6 instructions, so
    the answer for a tuple of tuples, which cannot change, is kept for the last few asked,
    looked up by identity (the kept reference keeps the identity from being reused).
    """
    frozen = type(programs) is tuple and all(type(prog) is tuple for prog in programs)
    seen = _KINDS_SEEN.get(id(programs)) if frozen else None
    if seen is not None and seen[0] is programs:
        return seen[1]
    op_of = attrgetter("op")
    kinds = frozenset().union(*(set(map(op_of, prog)) for prog in programs))  # scans in C
    if frozen:
        if len(_KINDS_SEEN) >= 4:
            _KINDS_SEEN.clear()
        _KINDS_SEEN[id(programs)] = (programs, kinds)
    return kinds


def fused_backwards(programs: Sequence[Sequence[Instr]]) -> frozenset[tuple[int, int]] | None:
    """(stage, mb) of every fused BW when the programs split other backwards into B and W.

    DualPipe mixes them: a full backward is one BW, a zero-bubble one is B then W. None when
    every backward has the same form, the common case.
    """
    kinds = op_kinds(programs)
    if Op.BW not in kinds or Op.B not in kinds:
        return None
    return frozenset((i.stage, i.mb) for prog in programs for i in prog if i.op is Op.BW)


def fused_set(compiled: Compiled) -> frozenset[tuple[int, int]]:
    """(stage, mb) whose backward is one fused BW: all, none, or DualPipe's mix."""
    programs = compiled.programs
    mixed = fused_backwards(programs)
    if mixed is not None:
        return mixed
    kinds = op_kinds(programs)
    if Op.B in kinds or Op.W in kinds:
        return frozenset()
    layout = compiled.layout
    return frozenset((s, i) for pl in layout.pipelines for s in pl.stages for i in pl.mbs)


Pred = tuple[Op | None, int]
"""A predecessor of (op, stage, mb) as (op, stage); the micro-batch is the node's own. An op
of None is the upstream backward: fused BW or split B as that (stage, mb) is computed."""


def dependency_table(layout: Layout, recompute: bool = False) -> dict[Op, list[tuple[Pred, ...]]]:
    """Per compute op, per stage: the predecessors of (op, stage, mb) (docs/design.md's edges).

    F(s,i)<-F(prev,i); B(last,i)<-F(last,i); B(s,i)<-B(next,i), F(s,i); W(s,i)<-B(s,i).
    With recompute, the backward also waits for RECOMPUTE(s,i), which waits for F(s,i).
    No edge changes the micro-batch, so one entry serves all of them: the hot loops (play,
    check_execution) read it inline instead of building 10^5 per-node tuples of tuples.
    """
    tables = layout._dependency_tables
    if recompute not in tables:
        table: dict[Op, list[tuple[Pred, ...]]] = {op: [] for op in COMPUTE_OPS}
        for s in range(layout.n_stages):
            prev, nxt = layout.prev_stage(s), layout.next_stage(s)
            backward = ((Op.F, s),) if nxt is None else ((None, nxt), (Op.F, s))
            if recompute:
                backward += ((Op.RECOMPUTE, s),)
            table[Op.F].append(() if prev is None else ((Op.F, prev),))
            table[Op.RECOMPUTE].append(((Op.F, s),))
            table[Op.B].append(backward)
            table[Op.BW].append(backward)
            table[Op.W].append(((Op.B, s),))
        tables[recompute] = table
    return tables[recompute]


def upstream_backward(op: Op, stage: int, mb: int, fused: frozenset[tuple[int, int]] | None) -> Op:
    """The backward of (stage, mb) that backward `op` of the stage before it waits for: the
    same kind, unless `fused` (see fused_backwards) says which backwards are fused."""
    if fused is None:
        return op
    return Op.BW if (stage, mb) in fused else Op.B


def dependencies(
    layout: Layout,
    node: tuple[Op, int, int],
    recompute: bool = False,
    fused: frozenset[tuple[int, int]] | None = None,
) -> tuple[tuple[Op, int, int], ...]:
    """Predecessors of compute node (op, stage, mb) in the work graph (see dependency_table).

    A fused BW follows the same edges as B (its upstream backward is a BW too, unless
    `fused` says which backwards are fused); non-compute ops have none.
    """
    op, s, i = node
    per_stage = dependency_table(layout, recompute).get(op)
    if per_stage is None:
        return ()
    return tuple(
        (upstream_backward(op, st, i, fused) if dop is None else dop, st, i)
        for dop, st in per_stage[s]
    )


def work_graph(layout: Layout, split_bw: bool, recompute: bool = False) -> nx.DiGraph:
    """The work graph: one node per compute op (op, stage, mb), edges for data dependencies.

    With `split_bw`, the backward is B then W; without, one fused BW node per (stage, mb).
    The passes read the same edges from `dependency_table`; networkx (a tenth of a second to
    import) is loaded only here.
    """
    import networkx as nx

    g = nx.DiGraph()
    kinds = [Op.F, Op.B, Op.W] if split_bw else [Op.F, Op.BW]
    if recompute:
        kinds.append(Op.RECOMPUTE)
    for pl in layout.pipelines:
        for s in pl.stages:
            for i in pl.mbs:
                g.add_nodes_from((k, s, i) for k in kinds)
    for node in list(g.nodes):
        g.add_edges_from((dep, node) for dep in dependencies(layout, node, recompute))
    return g
