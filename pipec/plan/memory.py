"""Per-rank peak memory of a candidate, in bytes: what is counted and under which assumptions.

Counted, per rank, over every stage the rank holds (a replica held twice counts twice):
- parameters: the measured parameter bytes of the stage's chunk (a tied parameter counts in
  each stage holding it, as the runtime holds it there);
- gradients: one gradient per parameter, in the parameters' dtype;
- optimizer state: AdamW's two moments in fp32 (8 bytes per parameter), plus an fp32 master
  copy (4 bytes per parameter) when the parameters are stored in a lower precision — the
  mixed-precision recipe of Megatron-LM; no ZeRO sharding across data-parallel copies;
- stashes: the simulator's peak of the rank program replayed with each chunk's measured stash
  bytes at the candidate's micro-batch size (`CostModel.stash_bytes`). Recompute keeps the
  chunk's measured input bytes instead, and evicted stashes count on the acceptor that holds
  them (the simulator's memory rules, whatever ops the program has).

Not counted: the working memory of the op in flight (its temporaries and the gradient being
produced), communication buffers, the allocator's fragmentation and the framework's context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from passes.simulate import SimResult
from pipec.ir import Layout, PipecError
from pipec.plan.facts import Chunks

ADAMW_MOMENT_BYTES = 2 * 4
"""AdamW's exp_avg and exp_avg_sq, each fp32, per parameter."""
MASTER_COPY_BYTES = 4
"""An fp32 master copy per parameter, kept when parameters are stored below 4 bytes."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, what: str = "--memory-per-device") -> int:
    """`80GiB`, `512MiB`, `1.5GB`, `1e9` or a plain byte count, as bytes."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise PipecError(
            f"{what} '{text}' is not a size; write bytes or a number with a unit such as "
            "80GiB, 512MiB, 1.5GB"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PipecError(f"{what} must be positive (got '{text}')")
    return int(value)


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak memory, in bytes, by what holds it."""

    params: int
    grads: int
    optimizer: int
    stash: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.stash

    def to_json(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "stash": self.stash,
            "total": self.total,
        }


def optimizer_bytes(params: int, param_bytes: int) -> int:
    """AdamW's state for `params` parameters stored in `param_bytes` bytes (see module doc)."""
    master = MASTER_COPY_BYTES if param_bytes < 4 * params else 0
    return params * (ADAMW_MOMENT_BYTES + master)


def held_chunks(layout: Layout, rank: int) -> list[int]:
    """The chunk of every stage `rank` holds (a chunk held by two stages appears twice)."""
    return [layout.stage_chunk[s] for s in layout.stages_of_rank(rank)]


def static_memory(layout: Layout, chunks: Chunks, rank: int) -> RankMemory:
    """Parameters, gradients and optimizer state of `rank` (no stash)."""
    held = held_chunks(layout, rank)
    weights = sum(chunks.param_bytes[c] for c in held)
    optimizer = sum(optimizer_bytes(chunks.params[c], chunks.param_bytes[c]) for c in held)
    return RankMemory(weights, weights, optimizer, 0)


def rank_memory(layout: Layout, sim: SimResult, chunks: Chunks) -> tuple[RankMemory, ...]:
    """Every rank's peak memory: static bytes from `chunks`, stash bytes the simulator's own
    peak (`sim` of programs compiled with `chunks.stash_bytes` in the cost model), so that the
    plan and `pipec compile`/the runtime's comparison count memory one way."""
    return tuple(
        replace(static_memory(layout, chunks, r), stash=round(s.peak_stash_bytes or 0))
        for r, s in enumerate(sim.ranks)
    )
