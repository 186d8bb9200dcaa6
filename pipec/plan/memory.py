"""Per-rank peak memory of a candidate, in real bytes, and the eviction limit a budget implies.

A candidate's peak is the runtime's own prediction (`passes/memory_bytes.py`, the figure
`pipec show` puts beside a run's measured peak) on the programs the plan compiled and
simulated, every term priced from the plan's profile at the candidate's micro-batch size
(`byte_facts`): parameters, gradients and AdamW's state from each chunk's measured parameters;
stashes at each chunk's measured stash bytes (input bytes when recomputed); each message and
each kept stage output at the floating bytes of the chunk's boundary; and on a CPU profile
autograd's host records per live stash and what B leaves for W, measured per block. The
prediction is for the profiled device (`for_device`): a CPU profile predicts a gloo run and
its CPU meter, a CUDA profile an NCCL run and the caching allocator's count. A candidate fits
when its highest rank's peak is at most the byte budget.

The budget becomes BPipe's limit (`stash_limit`) in the stash units `pipec compile
--memory-limit` takes, from the family's programs without eviction. Eviction moves stashes and
nothing else; everything else a rank holds stays where it is: weights, gradients, optimizer
state, message buffers, the stage outputs kept for the backward, host records. So per rank,
the bytes a stash limit cannot lower are the highest, over the step, of the prediction less
the simulator's stash bytes (`Samples.unmovable`), and the budget less those is what stashes
may take. A unit of stash weighs the bytes of the heaviest stash that can live on the rank
(its own chunks' and, as an acceptor, its BPipe partner's) over the units one stash counts.
The limit is the smallest over the ranks. The compiled candidate's own prediction then decides
whether it fits: a move in flight can still lift a rank above the bound for a moment.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipec.compile import CompileResult
from pipec.ir import Layout, PipecError
from pipec.passes.mapping import mirror_pairs
from pipec.passes.memory_bytes import ByteFacts, Samples, for_device, held_chunks, rank_samples
from pipec.plan.facts import Chunks
from pipec.runtime.calibration import GLOO_RECV_HOST

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


def byte_facts(chunks: Chunks, precision: str = "fp32", zero: int = 1) -> ByteFacts:
    """The prediction's per-chunk facts, from the profile's chunks (already at `precision`:
    `Chunks.at_bf16`), for a run at `precision` with ZeRO-1 over `zero` copies; the host bytes
    of a posted receive are the runtime's (on CUDA `for_device` drops every host term)."""
    return ByteFacts(
        chunks.params,
        chunks.param_bytes,
        tuple(float(b) for b in chunks.message_bytes),
        tuple(float(b) for b in chunks.host_bytes),
        tuple(float(b) for b in chunks.w_held_bytes),
        GLOO_RECV_HOST.value,
        precision=precision,
        zero=zero,
    )


def predicted(
    result: CompileResult, chunks: Chunks, device: str, precision: str = "fp32", zero: int = 1
) -> list[Samples]:
    """Every rank's bytes after each instruction of `result`'s programs, run on `device` at
    `precision` with ZeRO-1 over `zero` copies (1: none)."""
    facts, ahead = for_device(byte_facts(chunks, precision, zero), device)
    c = result.compiled
    return rank_samples(c.layout, c.programs, result.costs, result.sim, facts, ahead)


def stash_limit(
    layout: Layout, stash_bytes: Sequence[float], plain: Sequence[Samples], bytes_per_device: int
) -> float:
    """BPipe's limit, in stash units, that leaves every rank of the programs `plain` predicts
    (the family's, without eviction) within `bytes_per_device` (see the module doc); 0 where
    the bytes eviction cannot move already exceed it. One stash of a chunk counts
    `layout.stash_share` units and weighs its `stash_bytes`."""
    partner = {a: b for pair in mirror_pairs(layout) for a, b in (pair, pair[::-1])}
    limits = []
    for rank, samples in enumerate(plain):
        here = held_chunks(layout, rank)
        if rank in partner:
            here += held_chunks(layout, partner[rank])
        unit = max(stash_bytes[c] for c in here) / layout.stash_share
        limits.append((bytes_per_device - samples.unmovable()) / unit)
    return max(0.0, min(limits))
