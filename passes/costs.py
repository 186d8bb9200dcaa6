"""The cost model: how long each op takes and how much activation memory it holds.

Durations are in the user's unit (the zero-bubble papers' tables are in ms). By default
(`per="share"`) F, B, W and `allreduce` describe one rank's share of one model copy, a stage of
the model's p-way split: an op of a chunk takes that chunk's part of it, `Layout.stash_share`
(1/v with v chunks per rank; Chimera's and DualPipe's stages are whole shares of two replicas),
the rule that already weighs a chunk's stash. One micro-batch then keeps a rank equally busy
whatever v, so schedules of different v compare at the same costs. A list (`F=1:2:1:1`, one
value per model chunk) weighs the chunks apart in the same unit: equal values read as the
single value. With `per="chunk"` each value is one chunk op's own duration, as given: what a
model's measured stages are, and what papers that count chunk passes use. `of_chunks` turns
the first form into the second; a plan holds costs per chunk op.

`instr_overhead` is what the runtime spends per instruction beside the ops (its loop, issuing
a send, posting a receive), in the same unit; 0 leaves it out.

`comm` is the latency of one cross-rank transfer, never divided: a smaller chunk does not
make a message start sooner. A `topology` instead prices each transfer by the link it crosses
(latency + size / bandwidth; a pipeline message carries a stage input, `mem_input`, and an
evicted stash what F left). `allreduce` is the time of the gradient all-reduce between the two
ranks that hold a chunk's replicas; with `per="share"` it is given for one rank's share, and a
chunk's all-reduce takes the chunk's part (its gradients are that part of the parameters).

Memory is in units of one micro-batch's stash of one rank's full share of the model; a chunk's
op moves its part of these (`Layout.stash_share`): F adds `mem_F`, W adds `mem_W` (a release,
so negative) and B the rest, so that a micro-batch nets zero; with recompute, F keeps only
`mem_input` and RECOMPUTE adds back what is missing before the backward. With a model,
`stash_bytes` gives one micro-batch's stash of each chunk in bytes (measured by the frontend),
so memory is also reported in bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from pipec.ir import Instr, Layout, Op, PipecError
from pipec.passes.topology import Topology

_ITEM = re.compile(r"^(F|B|W|comm|allreduce|per)=([-+0-9.eE:]+|share|chunk)$")
_MEM_ITEM = re.compile(r"^(F|W|in)=([-+0-9.eE]+)$")


@dataclass(frozen=True)
class CostModel:
    """Per-op durations (of a rank's share, or per chunk op: `per`) and per-op activation
    memory deltas."""

    F: tuple[float, ...] = (1.0,)
    B: tuple[float, ...] = (1.0,)
    W: tuple[float, ...] = (1.0,)
    comm: float = 0.0
    mem_F: float = 1.0
    mem_W: float = -1.0
    mem_input: float = 1.0 / 16
    stash_bytes: tuple[float, ...] = ()
    """Bytes of one micro-batch's stash per model chunk; empty without a model."""
    topology: Topology | None = None
    allreduce: float = 0.0
    input_bytes: tuple[float, ...] = ()
    """Bytes of one micro-batch's stage inputs per model chunk (what a recomputed stage keeps
    from F to RECOMPUTE); empty without a model, where `mem_input` stands for it."""
    per: str = "share"
    """What F, B, W and `allreduce` describe: "share", one rank's share of the model (a chunk
    takes its part), or "chunk", one chunk's op. Durations are read per chunk op only."""
    instr_overhead: float = 0.0
    """The runtime's own time per instruction (its loop, issuing sends, posting receives),
    beside the ops' durations: the simulator charges it for every instruction of a program
    (`passes/simulate.py`, `instruction_charges`). 0: not counted."""

    def of_chunks(self, share: float) -> CostModel:
        """These costs per chunk op, for chunks that are `share` of a rank's share
        (`Layout.stash_share`); costs already per chunk op are returned as they are."""
        if self.per == "chunk":
            return self
        parts = {kind: tuple(x * share for x in getattr(self, kind)) for kind in "FBW"}
        return replace(self, **parts, allreduce=self.allreduce * share, per="chunk")

    def per_chunk(self, kind: str, chunk: int) -> float:
        """How long one op of `kind` of `chunk` runs (of costs per chunk op: `of_chunks`)."""
        assert self.per == "chunk", "costs of a rank's share: take them of_chunks(share) first"
        values = getattr(self, kind)
        return values[chunk] if len(values) > 1 else values[0]

    def duration(self, instr: Instr, layout: Layout) -> float:
        """How long a compute instruction runs; communication costs `comm` on arrival."""
        chunk = layout.stage_chunk[instr.stage]
        op = instr.op
        if op is Op.F or op is Op.RECOMPUTE:
            return self.per_chunk("F", chunk)
        if op is Op.B:
            return self.per_chunk("B", chunk)
        if op is Op.W:
            return self.per_chunk("W", chunk)
        if op is Op.BW:
            return self.per_chunk("B", chunk) + self.per_chunk("W", chunk)
        return 0.0

    def stash_size(self, recompute: bool) -> float:
        """What F leaves until the backward (in stashes of its stage): what EVICT moves."""
        return self.mem_input if recompute else self.mem_F

    def transfer_time(self, src: int, dst: int, size: float) -> float:
        """How long moving `size` stash units from rank src to rank dst takes."""
        if src == dst:
            return 0.0
        if self.topology is None:
            return self.comm
        return self.topology.link(src, dst).time(size)

    def mem_delta(self, op: Op, recompute: bool) -> float:
        """Activation memory an op adds (in stashes of its stage), from the fused/split rules."""
        if op is Op.F or op is Op.LOAD or op is Op.ACCEPT:
            return self.stash_size(recompute)
        if op is Op.EVICT or op is Op.RETURN:
            return -self.stash_size(recompute)
        if op is Op.RECOMPUTE:
            return self.mem_F - self.mem_input
        if op is Op.B:
            return -(self.mem_F + self.mem_W)
        if op is Op.W:
            return self.mem_W
        if op is Op.BW:
            return -self.mem_F
        return 0.0

    def check_chunks(self, n_chunks: int) -> None:
        for kind in ("F", "B", "W"):
            n = len(getattr(self, kind))
            if n not in (1, n_chunks):
                raise PipecError(
                    f"--costs {kind} has {n} values; give one, or one per model chunk ({n_chunks})"
                )
        if self.stash_bytes and len(self.stash_bytes) != n_chunks:
            raise PipecError(
                f"the model has {len(self.stash_bytes)} chunks, the schedule {n_chunks}; recompile"
            )

    def to_json(self) -> dict:
        out = {
            "F": list(self.F),
            "B": list(self.B),
            "W": list(self.W),
            "comm": self.comm,
            "mem_F": self.mem_F,
            "mem_W": self.mem_W,
            "mem_input": self.mem_input,
        }
        # Absent when unused, so schedule-only plans (and golden headers) keep their hash.
        if self.stash_bytes:
            out["stash_bytes"] = list(self.stash_bytes)
        if self.topology is not None:
            out["topology"] = self.topology.to_json()
        if self.allreduce:
            out["allreduce"] = self.allreduce
        if self.input_bytes:
            out["input_bytes"] = list(self.input_bytes)
        if self.per != "chunk":  # plans hold costs per chunk op (`of_chunks`): no key there
            out["per"] = self.per
        if self.instr_overhead:
            out["instr_overhead"] = self.instr_overhead
        return out

    @staticmethod
    def from_json(d: dict) -> CostModel:
        topology = Topology.from_json(d["topology"]) if "topology" in d else None
        return CostModel(
            tuple(d["F"]),
            tuple(d["B"]),
            tuple(d["W"]),
            d["comm"],
            d["mem_F"],
            d["mem_W"],
            d["mem_input"],
            tuple(d.get("stash_bytes", ())),
            topology,
            d.get("allreduce", 0.0),
            tuple(d.get("input_bytes", ())),
            per=d.get("per", "chunk"),
            instr_overhead=d.get("instr_overhead", 0.0),
        )


def _number(text: str, what: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise PipecError(f"{what}: '{text}' is not a number") from None
    if not math.isfinite(x):
        raise PipecError(f"{what}: '{text}' is not a finite number")
    return x


def _items(text: str, what: str, pattern: re.Pattern, expected: str) -> list[tuple[str, str]]:
    """`KEY=VALUE,...` as (key, value) pairs; one line naming `what` when the text is empty,
    an item does not read, or a key comes twice (the last would silently win)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise PipecError(f"{what} is empty; expected {expected} (or leave the option out)")
    pairs = []
    for item in items:
        m = pattern.match(item)
        if not m:
            raise PipecError(f"{what}: cannot read '{item}'; expected {expected}")
        if any(key == m.group(1) for key, _ in pairs):
            raise PipecError(f"{what} gives {m.group(1)} twice; give each key once")
        pairs.append(m.groups())
    return pairs


#: The largest time --costs takes: a makespan sums up to p·m·v of them, which must stay finite.
COST_MAX = 1e15


def parse_costs(text: str, base: CostModel | None = None) -> CostModel:
    """Parse `--costs F=1,B=1,W=1,comm=0` (any subset; `F=1:2:1:1` weighs each chunk;
    `per=chunk`: the values are per chunk op, `per=share` (the default) of a rank's share)."""
    fields: dict = {}
    expected = (
        "KEY=VALUE with KEY in F, B, W, comm, allreduce, per (share or chunk), "
        "e.g. --costs F=1,B=2,W=1,comm=0.1"
    )
    for key, value in _items(text, "--costs", _ITEM, expected):
        if key == "per":
            if value not in ("share", "chunk"):
                raise PipecError(f"--costs per={value}: give per=share or per=chunk")
            fields[key] = value
        elif key in ("comm", "allreduce"):
            fields[key] = _number(value, f"--costs {key}")
        else:
            fields[key] = tuple(_number(v, f"--costs {key}") for v in value.split(":"))
    for key, value in fields.items():
        values = value if isinstance(value, tuple) else (value,)
        if key != "per" and min(values) < 0:
            raise PipecError(f"--costs {key} must not be negative")
        if key != "per" and max(values) > COST_MAX:  # sums of such times overflow to inf
            raise PipecError(f"--costs {key} must be at most {COST_MAX:g}; use a larger unit")
    return replace(base or CostModel(), **fields)


def parse_mem(text: str, base: CostModel) -> CostModel:
    """Parse `--mem F=a,W=-c[,in=r]`: memory F adds, W adds (negative), recompute's input stash."""
    fields: dict = {}
    expected = "F=a, W=-c or in=r, e.g. --mem F=1,W=-0.5"
    for key, value in _items(text, "--mem", _MEM_ITEM, expected):
        fields[{"F": "mem_F", "W": "mem_W", "in": "mem_input"}[key]] = _number(value, "--mem")
    out = replace(base, **fields)
    if out.mem_F <= 0 or out.mem_W > 0 or -out.mem_W > out.mem_F:
        raise PipecError("--mem needs F > 0 and -F <= W <= 0 (W releases part of what F added)")
    return out
