"""What a profile of the model at several micro-batch sizes holds, and the chunks derived from it.

The model is profiled block by block (one block = one entry of the model's ModuleList, the
embedding with the first and the head and loss with the last, as the frontend cuts them), so
that any partition into chunks (p for 1F1B, p·v for interleaved, 2p for V-shapes) is priced by
summing its blocks. These values carry no torch: tests build them from synthetic MFU curves.
`ModelProfile.to_json`/`from_json` round-trip exactly (JSON prints floats as `repr` does), so
a profile read back from a file prices every candidate as the one measured.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

from pipec.ir import PipecError
from pipec.plan.conditions import Conditions


@dataclass(frozen=True)
class FBW:
    """F, B, W of one block or chunk: FLOPs per sample, or seconds per micro-batch."""

    F: float
    B: float
    W: float

    @property
    def total(self) -> float:
        return self.F + self.B + self.W

    @staticmethod
    def from_json(d: dict[str, float]) -> FBW:
        return FBW(d["F"], d["B"], d["W"])


@dataclass(frozen=True)
class BlockFacts:
    """One block: its parameters, its FLOPs per sample (the frontend's estimate) and the
    seconds of one AdamW step over its parameters (0: not measured)."""

    params: int
    param_bytes: int
    flops: FBW
    optimizer_s: float = 0.0


@dataclass(frozen=True)
class MbsPoint:
    """Measurements at one micro-batch size, per block.

    seconds: F, B, W (B/W split as the runtime splits them); stash_bytes: what autograd keeps
    from F to the backward; input_bytes: the block's received inputs (what a recomputing stage
    keeps instead); message_bytes: the floating values among them, what a stage boundary
    before the block sends (and its gradient brings back); fused_backward: seconds of the
    backward in one pass, the runtime's BW (empty: B + W, as for synthetic profiles);
    host_bytes: what the CPU meter sees a live stash hold beyond its tensors (autograd's
    records of the graph) with the B/W split, fused_host_bytes without it (a BW schedule's
    native Linears); w_held_bytes: what B leaves for W (the Linear inputs and output
    gradients). The last three are measured on CPU only (empty: not counted, as on a GPU).
    """

    mbs: int
    seconds: tuple[FBW, ...]
    stash_bytes: tuple[int, ...]
    input_bytes: tuple[int, ...]
    message_bytes: tuple[int, ...]
    fused_backward: tuple[float, ...] = ()
    host_bytes: tuple[int, ...] = ()
    fused_host_bytes: tuple[int, ...] = ()
    w_held_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Chunks:
    """A partition's model chunks at one micro-batch size: per-chunk costs and bytes."""

    counts: tuple[int, ...]
    seconds: tuple[FBW, ...]
    stash_bytes: tuple[int, ...]
    input_bytes: tuple[int, ...]
    params: tuple[int, ...]
    param_bytes: tuple[int, ...]
    message_bytes: tuple[int, ...] = ()
    """Bytes of each chunk's output message (its activation sent on; 0 for the last)."""
    fused_backward: tuple[float, ...] = ()
    """Seconds of each chunk's backward in one pass (BW); empty: B + W."""
    optimizer_s: tuple[float, ...] = ()
    """Seconds of each chunk's AdamW step; empty: not measured."""
    host_bytes: tuple[int, ...] = ()
    """Per chunk, autograd's host bytes per live stash (a CPU profile; empty: not counted)."""
    fused_host_bytes: tuple[int, ...] = ()
    """The same without the B/W split (a schedule that runs BW only)."""
    w_held_bytes: tuple[int, ...] = ()
    """Per chunk, what B leaves for W (a CPU profile; empty: W frees the simulator's share)."""

    def at_bf16(self) -> Chunks:
        """These chunks trained at `--precision bf16`: what activations weigh halves (stashes,
        inputs, messages, what W holds; the profile ran the fp32 model), autograd's host
        records do not. Weights, gradients and optimizer state are ByteFacts' to price."""

        def half(values: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(v // 2 for v in values)

        return replace(
            self,
            stash_bytes=half(self.stash_bytes),
            input_bytes=half(self.input_bytes),
            message_bytes=half(self.message_bytes),
            w_held_bytes=half(self.w_held_bytes),
        )

    def fused(self) -> Chunks:
        """These chunks as a schedule without separate W prices them: it only ever runs BW,
        which the cost model times as B + W, so B and W are scaled to sum to the fused time;
        its stashes hold the host bytes of native Linears, and nothing waits for W."""
        chunks = replace(self, host_bytes=self.fused_host_bytes, w_held_bytes=())
        if not self.fused_backward:
            return chunks
        scale = [bw / (c.B + c.W) for bw, c in zip(self.fused_backward, self.seconds)]
        seconds = tuple(FBW(c.F, c.B * k, c.W * k) for c, k in zip(self.seconds, scale))
        return replace(chunks, seconds=seconds)


@dataclass(frozen=True)
class ModelProfile:
    """The model's blocks, its measured points (ascending mbs) and the device's peak.

    tokens_per_sample: elements of the first input per sample (the sequence length for token
    ids); peak_flops: the device's peak in FLOP/s and `peak_source` where that figure comes
    from; stopped: why the sweep ended where it did.
    """

    name: str
    blocks: tuple[BlockFacts, ...]
    points: tuple[MbsPoint, ...]
    tokens_per_sample: int
    peak_flops: float
    peak_source: str
    stopped: str = ""
    factory_sized: bool = False
    """Each size's micro-batch came from the factory's `micro_batch_size` keyword (else the
    one example micro-batch, sliced or repeated)."""
    device: str = "cpu"
    """The device type profiled ("cpu" or "cuda"): the one the plan's memory is predicted for
    (its meter, its backend's receive policy)."""
    conditions: Conditions | None = None
    """What the sweep ran under (one process, timed alone; None: not recorded)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> ModelProfile:
        def point(p: dict[str, Any]) -> MbsPoint:
            return MbsPoint(
                p["mbs"],
                tuple(FBW.from_json(s) for s in p["seconds"]),
                tuple(p["stash_bytes"]),
                tuple(p["input_bytes"]),
                tuple(p["message_bytes"]),
                tuple(p["fused_backward"]),
                tuple(p["host_bytes"]),
                tuple(p["fused_host_bytes"]),
                tuple(p["w_held_bytes"]),
            )

        blocks = tuple(
            BlockFacts(b["params"], b["param_bytes"], FBW.from_json(b["flops"]), b["optimizer_s"])
            for b in d["blocks"]
        )
        points = tuple(point(p) for p in d["points"])
        scalars = {k: v for k, v in d.items() if k not in ("blocks", "points", "conditions")}
        conditions = Conditions.from_json(d["conditions"]) if d.get("conditions") else None
        return ModelProfile(blocks=blocks, points=points, conditions=conditions, **scalars)

    @cached_property
    def flops_per_sample(self) -> float:
        """Model FLOPs of one sample's forward and backward (F + B + W over all blocks)."""
        return sum(b.flops.total for b in self.blocks)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(pt.mbs for pt in self.points)

    def point(self, mbs: int) -> MbsPoint:
        for pt in self.points:
            if pt.mbs == mbs:
                return pt
        raise PipecError(f"micro-batch size {mbs} was not profiled (profiled: {self.sizes})")

    def mfu(self, mbs: int) -> float:
        """Single-device MFU at `mbs`: the model's FLOPs over the summed block times and peak."""
        seconds = sum(s.total for s in self.point(mbs).seconds)
        return self.flops_per_sample * mbs / seconds / self.peak_flops

    def partition(self, n_chunks: int) -> tuple[int, ...]:
        """Blocks per chunk: the frontend's balanced partition (equal FLOPs), so a build with
        `--partition balanced` runs the stages priced here."""
        from pipec.frontend import FrontendError
        from pipec.frontend.partition import resolve

        try:
            _, counts = resolve("balanced", [b.flops.total for b in self.blocks], n_chunks)
        except FrontendError as e:
            raise PipecError(str(e)) from None
        return tuple(counts)

    def chunks(self, n_chunks: int, mbs: int) -> Chunks:
        """Per-chunk seconds and bytes at `mbs`: sums over the chunk's blocks.

        A chunk's received input is its first block's, its output message the next chunk's
        first block's; a block boundary inside a chunk is stashed by the block that consumes
        it, so summed stashes count it once. Host bytes and W's hold add up over blocks.
        """
        counts = self.partition(n_chunks)
        pt = self.point(mbs)
        starts = [sum(counts[:k]) for k in range(n_chunks)]
        spans = [range(a, a + c) for a, c in zip(starts, counts)]

        def total(values) -> tuple:  # type: ignore[no-untyped-def]
            return tuple(sum(values[i] for i in span) for span in spans)

        seconds = tuple(
            FBW(*(sum(getattr(pt.seconds[i], k) for i in span) for k in "FBW")) for span in spans
        )
        return Chunks(
            counts=counts,
            seconds=seconds,
            stash_bytes=total(pt.stash_bytes),
            input_bytes=tuple(pt.input_bytes[a] for a in starts),
            params=total([b.params for b in self.blocks]),
            param_bytes=total([b.param_bytes for b in self.blocks]),
            message_bytes=tuple(pt.message_bytes[a] for a in starts[1:]) + (0,),
            fused_backward=total(pt.fused_backward) if pt.fused_backward else (),
            optimizer_s=total([b.optimizer_s for b in self.blocks]),
            host_bytes=total(pt.host_bytes) if pt.host_bytes else (),
            fused_host_bytes=total(pt.fused_host_bytes) if pt.fused_host_bytes else (),
            w_held_bytes=total(pt.w_held_bytes) if pt.w_held_bytes else (),
        )
