"""Peak real bytes per rank: what one training step of the programs holds at its highest.

The prediction plays the memory of every rank on the simulated timeline and samples it after
each instruction, where the runtime's meter reads it (runtime/meter.py). At each point a rank
holds, term by term (every figure a measured fact of the model, in bytes):

- params: its stages' parameters (a chunk held by two stages counts twice), in bf16 under
  `launch.py --precision bf16`;
- optimizer: AdamW's state for them (`optimizer_bytes`: under bf16 with the fp32 master
  copy; 1/D of it with ZeRO-1 over D copies), which exists from the end of the first step on:
  the prediction is of a step after it;
- grads: a stage's gradients (fp32 `main_grad`s under bf16), from its first backward op of
  the step (B, BW or W) to the optimizer step, which frees them (the runtime zeroes gradients
  to None);
- stash: the simulator's live stashes, each weighing its chunk's stash bytes (what autograd
  saves, measured by the frontend; a recomputed forward keeps its input bytes until RECOMPUTE),
  under the simulator's rules for F, B, W, RECOMPUTE, EVICT and LOAD (`activation_profile`);
  plus the stage output each forward keeps for its backward (autograd needs the tensor), which
  the frontend's measure leaves out when no op saved it; from B to W (the B/W split), what W
  needs (the Linear inputs and output gradients), where measured, instead of the simulator's
  share of the stash;
- buffers: messages and stash moves in flight. A received activation or gradient holds its
  buffer from where the runtime posts the receive (`post_points`) to the op that consumes it.
  A sent gradient, or the activation of a forward that keeps nothing, is held from the op
  that made it until the first instruction that ends after its transfer completed (the
  receiver posted, plus `comm` or the link's time). An evicted stash's buffer is held from
  EVICT to the end of its transfer, a returned one from RETURN to the end of the load
  (`SimResult.transfers`), and never past the rank's next instruction that allocates stash
  bytes (`ALLOCATES`), before which the runtime waits for them. A tensor for a later stage
  on the same rank is held until that stage consumes it;
- held: stashes evicted by partners, from ACCEPT to RETURN;
- host: (CPU runs) autograd's own records of each live stash's graph (nodes, tensor headers),
  from F or RECOMPUTE to the backward, per chunk as measured on this machine; and each posted
  receive's records beside its buffer (`ByteFacts.recv_host`: the runtime's calibration,
  runtime/calibration.py, which the caller passes in). A GPU keeps them in host
  memory, which its meter does not count: there this term is absent.

Under bf16 (`at_precision`) what activations weigh halves: stashes, messages, what W holds
(the model's own activations being fp32); autograd's host records do not. Not modelled: the
working memory inside an instruction (the meter samples between them), a
tensor shared by two terms (an output a later op of the same stage saves counts twice), the
micro-batches' token ids and targets (kilobytes).

`for_device` says which terms a device's meter sees and where its backend posts receives.
`rank_samples` gives every sample by term; `predict_peaks` the highest. Two callers, one
prediction: `pipec show` (runtime/measure.py, facts from a build's stages) and `pipec plan`
(pipec/plan/memory.py, facts from the profile's blocks, which also derives an eviction limit
from what a stash limit cannot lower, `Samples.unmovable`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from pipec.ir import COMPUTE_OPS, RECV_OPS, Instr, Layout, Op
from pipec.passes.costs import CostModel
from pipec.passes.simulate import SimResult, bytes_profile, uses_recompute

ADAMW_MOMENT_BYTES = 2 * 4
"""AdamW's exp_avg and exp_avg_sq, each fp32, per parameter."""
MASTER_COPY_BYTES = 4
"""An fp32 master copy per parameter, kept when parameters are stored below 4 bytes."""

#: Bytes per element of the dtypes a stage boundary carries (plan.json names them).
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
_BACKWARDS = (Op.B, Op.BW)
#: Relative tolerance within which two simulated times are the same (`rank_samples`).
TIE = 1e-9
#: Instructions that allocate stash bytes (a new stash, a stash buffer to receive into). Before
#: one of them the runtime waits for its rank's stash moves out to complete (runtime/offload.py).
ALLOCATES = frozenset({Op.F, Op.RECOMPUTE, Op.LOAD, Op.ACCEPT})


#: How many compute instructions before its consumer the runtime posts a receive, per backend
#: (None: all of a step's receives at its start). NCCL matches in issue order, so its receives
#: stay at their program positions.
POST_AHEAD: dict[str, int | None] = {"gloo": None, "nccl": 0}


def post_ahead(backend: str) -> int | None:
    """The runtime's receive policy on `backend` (see `post_points`)."""
    return POST_AHEAD.get(backend, 0)


#: The backend the runtime runs on each device type.
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def for_device(
    facts: ByteFacts, device: str, backend: str | None = None
) -> tuple[ByteFacts, int | None]:
    """`facts` as the meter of a run on `device` ("cpu" or "cuda") sees them, and where that
    run posts its receives (`post_points`) on `backend` (default: the device's; gloo on CUDA is
    `launch.py --share-gpu`). On CPU every term counts, each posted receive's host bytes as
    `facts.recv_host` gives them. On CUDA host bytes are not device bytes, and W holds the
    simulator's share (the measure of what W holds runs the model on the host)."""
    if device != "cpu":
        facts = replace(facts, host=(), w_held=(), recv_host=0.0)
    return facts, post_ahead(backend or BACKENDS.get(device, "nccl"))


def optimizer_bytes(params: int, param_bytes: int, precision: str = "fp32", zero: int = 1) -> int:
    """AdamW's state for `params` parameters stored in `param_bytes` bytes, as runtime/optim.py
    holds it: at fp32, two moments in the parameters' own dtype; at bf16, two fp32 moments and
    the fp32 master copy (Megatron-LM's mixed-precision recipe); with ZeRO-1 over `zero`
    data-parallel copies, a 1/zero share of either."""
    if precision == "bf16":
        state = params * (ADAMW_MOMENT_BYTES + MASTER_COPY_BYTES)
    else:
        state = 2 * param_bytes
    return -(-state // zero)


def at_precision(
    facts: ByteFacts, costs: CostModel, precision: str, zero: int = 1, priced: str = "fp32"
) -> tuple[ByteFacts, CostModel]:
    """`facts` and `costs` of a run at `precision` ("fp32" or "bf16") with ZeRO-1 over `zero`
    copies: under bf16 the activations of an fp32 model weigh half (stashes, messages, what W
    holds); weights, gradients and optimizer state follow `ByteFacts`' precision. `priced`:
    the precision `costs`' stash bytes are priced at (`stashes_at`)."""
    if precision == "bf16":
        facts = replace(facts, message=_half(facts.message), w_held=_half(facts.w_held))
    return replace(facts, precision=precision, zero=zero), stashes_at(costs, precision, priced)


#: What an activation of an fp32 model weighs at each `--precision`, as a share of fp32.
ACTIVATION_SHARE = {"fp32": 1.0, "bf16": 0.5}


def stashes_at(costs: CostModel, precision: str, priced: str = "fp32") -> CostModel:
    """`costs` whose stash and input bytes are priced at `priced` (the plan's, `pipec compile
    --precision`; the model's own dtype by default), priced at `precision` instead."""
    scale = ACTIVATION_SHARE[precision] / ACTIVATION_SHARE[priced]
    if scale == 1.0:
        return costs
    return replace(
        costs,
        stash_bytes=tuple(b * scale for b in costs.stash_bytes),
        input_bytes=tuple(b * scale for b in costs.input_bytes),
    )


def _half(values: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(v / 2 for v in values)


def held_chunks(layout: Layout, rank: int) -> list[int]:
    """The chunk of every stage `rank` holds (a chunk held by two stages appears twice)."""
    return [layout.stage_chunk[s] for s in layout.stages_of_rank(rank)]


def post_points(program: Sequence[Instr], ahead: int | None) -> dict[int, list[int]]:
    """Where the runtime posts each activation or gradient receive: {k: positions of the
    receives posted just before instruction k}. A receive is posted before the compute
    instruction `ahead` compute instructions before it (at its own position for 0, at the
    step's start when fewer precede it); `ahead` None posts every receive at the start."""
    posts: dict[int, list[int]] = {}
    computes: list[int] = []
    for j, instr in enumerate(program):
        if instr.op in RECV_OPS:
            if ahead is None or len(computes) < ahead:
                k = 0
            else:
                k = computes[-ahead] if ahead else j
            posts.setdefault(k, []).append(j)
        elif instr.op in COMPUTE_OPS:
            computes.append(j)
    return posts


@dataclass(frozen=True)
class ByteFacts:
    """Per model chunk: parameters and their bytes, the bytes of one message on its output
    boundary (the activation it sends on, the gradient that comes back; 0 for the last chunk);
    for a CPU run, autograd's host bytes per live stash (empty: not counted); with the B/W
    split, the bytes B leaves for W (empty: the simulator's rule, W releases the stash)."""

    params: tuple[int, ...]
    param_bytes: tuple[int, ...]
    message: tuple[float, ...]
    host: tuple[float, ...] = ()
    w_held: tuple[float, ...] = ()
    recv_host: float = 0.0
    """Host bytes a posted receive holds beside its buffer (a CPU run; 0: not counted)."""
    precision: str = "fp32"
    """`launch.py --precision`: bf16 holds bf16 weights, fp32 gradients and masters."""
    zero: int = 1
    """Data-parallel copies ZeRO-1 shards the masters and optimizer state over (1: none)."""

    def weights(self, chunk: int) -> int:
        """Bytes of a chunk's parameters as the run holds them."""
        return 2 * self.params[chunk] if self.precision == "bf16" else self.param_bytes[chunk]

    def gradients(self, chunk: int) -> int:
        """Bytes of a chunk's gradients: fp32 `main_grad`s under bf16."""
        return 4 * self.params[chunk] if self.precision == "bf16" else self.param_bytes[chunk]

    def optimizer(self, chunk: int) -> int:
        """Bytes of a chunk's optimizer state (and masters) on one rank (`optimizer_bytes`)."""
        return optimizer_bytes(
            self.params[chunk], self.param_bytes[chunk], self.precision, self.zero
        )

    @staticmethod
    def from_plan(
        plan: dict, host: Sequence[float] = (), w_held: Sequence[float] = (), recv_host: float = 0.0
    ) -> ByteFacts:
        """From a build's plan.json: the frontend's per-chunk facts, and the host ones of a CPU
        run (the runtime's)."""
        stages = plan["model"]["stages"]
        message = tuple(
            sum(
                math.prod(t["shape"]) * ITEMSIZE[t["dtype"]]
                for t in st["outputs"]
                if t["dtype"] in ITEMSIZE
            )
            if k + 1 < len(stages)
            else 0.0
            for k, st in enumerate(stages)
        )
        return ByteFacts(
            tuple(st["params"] for st in stages),
            tuple(st["param_bytes"] for st in stages),
            message,
            tuple(host),
            tuple(w_held),
            recv_host,
        )


@dataclass(frozen=True)
class RankBytes:
    """One rank's predicted peak in bytes, by term, and the instruction after which it is
    reached (`after`, an index into the rank's program)."""

    params: int
    optimizer: int
    grads: int
    stash: int
    buffers: int
    held: int
    host: int
    after: int

    @property
    def total(self) -> int:
        return sum(getattr(self, t) for t in TERMS)

    def to_json(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"total": self.total}


TERMS = tuple(f.name for f in fields(RankBytes) if f.name != "after")
"""A rank's predicted peak, term by term: what `RankBytes.total` sums."""


@dataclass(frozen=True)
class Samples:
    """One rank's bytes after each instruction of its program: the terms that change during
    the step (`series`, by RankBytes's names) beside the constant `params` and `optimizer`;
    `profile` is the simulator's stash bytes in them (its live and held stashes at their
    chunks' stash bytes), the part of the `stash` and `held` terms that eviction moves."""

    params: int
    optimizer: int
    series: dict[str, list[float]]
    profile: list[float]

    def varying(self) -> list[float]:
        """Bytes after each instruction, less the constant parameters and optimizer state."""
        return [sum(v[k] for v in self.series.values()) for k in range(len(self.profile))]

    def peak(self) -> RankBytes:
        """The highest sample, by term (the first where several tie)."""
        n = len(self.profile)
        totals = self.varying()
        at = max(range(n), key=totals.__getitem__) if n else 0
        terms = {t: round(v[at]) if n else 0 for t, v in self.series.items()}
        return RankBytes(self.params, self.optimizer, after=at, **terms)

    def unmovable(self) -> float:
        """The most bytes the rank holds beside the simulator's stashes at any sample: what a
        stash limit cannot lower (weights, gradients, buffers, kept outputs, host records)."""
        beside = (t - s for t, s in zip(self.varying(), self.profile))
        return self.params + self.optimizer + max(beside, default=0.0)


def sample_times(program: Sequence[Instr], slots: Sequence) -> list[float]:
    """Simulated time of each instruction's end: a compute op's slot end, any other op the
    end of the compute op before it (0 before the first)."""
    out, t, it = [], 0.0, iter(slots)
    for instr in program:
        if instr.op in COMPUTE_OPS:
            t = next(it).end
        out.append(t)
    return out


class _Ledger:
    """Per term, a difference array over a rank's samples: bytes live at samples [k0, k1)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.diff = {
            name: [0.0] * (n + 1) for name in ("grads", "stash", "buffers", "held", "host")
        }

    def hold(self, term: str, k0: int, k1: int, nbytes: float) -> None:
        if k1 > k0 and nbytes:
            self.diff[term][k0] += nbytes
            self.diff[term][k1] -= nbytes

    def series(self, term: str) -> list[float]:
        out, run = [], 0.0
        for d in self.diff[term][: self.n]:
            run += d
            out.append(run)
        return out


def rank_samples(
    layout: Layout,
    programs: Sequence[Sequence[Instr]],
    costs: CostModel,
    sim: SimResult,
    facts: ByteFacts,
    post_ahead: int | None,
) -> list[Samples]:
    """Every rank's bytes by term after each instruction (see the module doc) for programs
    simulated as `sim` under `costs`, whose `stash_bytes` (and `input_bytes` with recompute)
    price the stashes; `post_ahead` is the runtime's receive policy (`post_points`)."""
    recompute = uses_recompute(programs)
    chunk_of = layout.stage_chunk
    moved = costs.input_bytes if recompute else costs.stash_bytes  # what one stash move carries
    times = [sample_times(prog, sim.timeline[r]) for r, prog in enumerate(programs)]
    index = [{(i.op, i.stage, i.mb): k for k, i in enumerate(prog)} for prog in programs]
    posts = [post_points(prog, post_ahead) for prog in programs]
    posted_at: dict[tuple[int, Op, int, int], float] = {}
    for q, prog in enumerate(programs):
        for k, js in posts[q].items():
            for j in js:
                i = prog[j]
                posted_at[(q, i.op, i.stage, i.mb)] = times[q][k - 1] if k else 0.0
    moves = {(t.kind, t.stage, t.mb): t.end for t in sim.transfers}
    size = costs.mem_input * layout.stash_share  # a message, in the simulator's stash units

    def backward_of(r: int, stage: int, mb: int) -> int:
        return next(index[r][(op, stage, mb)] for op in _BACKWARDS if (op, stage, mb) in index[r])

    # Simulated times that tie (a transfer ends as the op waiting for it starts) can differ
    # in their last bits when the costs are in other units (a plan's seconds, a build's ms):
    # a time within TIE of the makespan is taken as reached.
    tie = TIE * sim.makespan

    def released(r: int, k: int, done: float) -> int:
        """The first sample of rank r after instruction k that ends at or after `done`; the
        optimizer step's drain (the last instruction) at the latest."""
        return min(bisect_left(times[r], done - tie, lo=k + 1), len(times[r]) - 1)

    def sent(r: int, k_made: int, k_send: int, recv: tuple[int, Op, int, int], nbytes: float):
        done = max(times[r][k_send], posted_at.get(recv, 0.0))
        done += costs.transfer_time(r, recv[0], size)
        book.hold("buffers", k_made, released(r, k_send, done), nbytes)

    samples = []
    for r, prog in enumerate(programs):
        n, idx = len(prog), index[r]
        book = _Ledger(n)
        recv_post = {j: k for k, js in posts[r].items() for j in js}
        step = idx.get((Op.OPTIMIZER_STEP, None, None), n)
        first_backward: dict[int, int] = {}
        for k, i in enumerate(prog):
            op, s, mb = i.op, i.stage, i.mb
            c = chunk_of[s] if s is not None else None
            if op in (Op.B, Op.BW, Op.W):
                first_backward.setdefault(s, k)
            if op is Op.F or op is Op.RECOMPUTE:
                nxt = layout.next_stage(s)
                kept = (Op.RECOMPUTE, s, mb) not in idx or op is Op.RECOMPUTE
                if nxt is not None and kept and (op is Op.RECOMPUTE or layout.stage_rank[nxt] != r):
                    book.hold("stash", k, backward_of(r, s, mb), facts.message[c])
                if facts.host and kept:
                    book.hold("host", k, backward_of(r, s, mb), facts.host[c])
                if op is Op.F and nxt is not None and layout.stage_rank[nxt] == r:
                    book.hold("buffers", k, idx[(Op.F, nxt, mb)], facts.message[c])
            elif op in RECV_OPS:
                if op is Op.RECV_ACT:
                    nbytes, consumer = (
                        facts.message[chunk_of[layout.prev_stage(s)]],
                        idx[(Op.F, s, mb)],
                    )
                else:
                    nbytes, consumer = facts.message[c], backward_of(r, s, mb)
                book.hold("buffers", recv_post[k], consumer, nbytes)
                book.hold("host", recv_post[k], consumer, facts.recv_host)
            elif op is Op.SEND_GRAD:
                prev = layout.prev_stage(s)
                sent(
                    r,
                    backward_of(r, s, mb),
                    k,
                    (i.peer, Op.RECV_GRAD, prev, mb),
                    facts.message[chunk_of[prev]],
                )
            elif op is Op.SEND_ACT and (Op.RECOMPUTE, s, mb) in idx:
                nxt = layout.next_stage(s)
                sent(r, idx[(Op.F, s, mb)], k, (i.peer, Op.RECV_ACT, nxt, mb), facts.message[c])
            elif op in _BACKWARDS:
                if op is Op.B and facts.w_held:  # what W holds, not the simulator's share
                    between = -costs.mem_W / costs.mem_F * costs.stash_bytes[c]
                    book.hold("stash", k, idx[(Op.W, s, mb)], facts.w_held[c] - between)
                prev = layout.prev_stage(s)
                if prev is not None and layout.stage_rank[prev] == r:
                    book.hold("buffers", k, backward_of(r, prev, mb), facts.message[chunk_of[prev]])
            elif op is Op.EVICT or op is Op.RETURN:
                end = moves[("evict" if op is Op.EVICT else "load", s, mb)]
                settled = next((j for j in range(k + 1, n) if prog[j].op in ALLOCATES), n - 1)
                book.hold("buffers", k, min(released(r, k, end), settled), moved[c])
            elif op is Op.ACCEPT:
                book.hold("held", k, idx[(Op.RETURN, s, mb)], moved[c])
        for s, k in first_backward.items():
            book.hold("grads", k, step, facts.gradients(chunk_of[s]))
        profile = bytes_profile(prog, layout, costs, recompute)
        series = {t: book.series(t) for t in book.diff}
        series["stash"] = [a + b - h for a, b, h in zip(series["stash"], profile, series["held"])]
        held = held_chunks(layout, r)
        params = sum(facts.weights(ch) for ch in held)
        optimizer = sum(facts.optimizer(ch) for ch in held)
        samples.append(Samples(params, optimizer, series, profile))
    return samples


def predict_peaks(
    layout: Layout,
    programs: Sequence[Sequence[Instr]],
    costs: CostModel,
    sim: SimResult,
    facts: ByteFacts,
    post_ahead: int | None,
) -> tuple[RankBytes, ...]:
    """Every rank's peak real bytes (see the module doc and `rank_samples`)."""
    return tuple(s.peak() for s in rank_samples(layout, programs, costs, sim, facts, post_ahead))
