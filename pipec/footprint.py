"""What a compile will cost, from its shape alone, so that one too large is refused before it
starts instead of filling the machine's memory.

A compile holds a few objects per work-graph op (instructions, timeline slots, the verifier's
sets): about `BYTES_PER_OP` per (stage, micro-batch) pair, p·v·m of them. The simulator also
keeps, per rank, each stage's message delay to it: p·S entries for S = p·v stages, which
dominate once p reaches the thousands (p = 20 000, m = 8: 6.7 GB). The constants are peak
resident sizes and times of `pipec compile` on the development machine (1f1b and interleaved,
p·m from 512 to 65 536, p up to 6 000); they overestimate by 5-20 %
(tests/test_footprint.py holds them to within -10 % and +50 %).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipec.codegen.render import format_bytes
from pipec.ir import PipecError

BASE_BYTES = 30e6  # the interpreter, pipec's modules
BYTES_PER_OP = 2.3e3
BYTES_PER_RANK_STAGE = 17
SECONDS_PER_OP = 25e-6
SECONDS_PER_RANK_STAGE = 150e-9


@dataclass(frozen=True)
class Footprint:
    """A compile's estimated peak memory (bytes) and time (seconds, on a quiet core)."""

    ops: int
    bytes: float
    seconds: float

    def __str__(self) -> str:
        return (
            f"{self.ops} stage ops, about {format_bytes(self.bytes)} and {_duration(self.seconds)}"
        )


def footprint(p: int, m: int, v: int) -> Footprint:
    """The estimate for p ranks, m micro-batches and v chunks per rank."""
    ops = p * v * m
    pairs = p * p * v
    return Footprint(
        ops,
        BASE_BYTES + BYTES_PER_OP * ops + BYTES_PER_RANK_STAGE * pairs,
        SECONDS_PER_OP * ops + SECONDS_PER_RANK_STAGE * pairs,
    )


def check_fits(p: int, m: int, v: int) -> Footprint:
    """The shape's footprint; PipecError when it needs more memory than the system reports
    free now."""
    need = footprint(p, m, v)
    free = available_bytes()
    if free is not None and need.bytes > free:
        raise PipecError(
            f"p={p} m={m} v={v} would need about {format_bytes(need.bytes)} to compile "
            f"({need.ops} stage ops; the simulator's tables grow as p^2·v), more than the "
            f"{format_bytes(free)} free here; use a smaller --pp or --microbatches"
        )
    return need


def available_bytes() -> float | None:
    """Memory the system can give this process now (Linux: MemAvailable), else all of it;
    None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else "under a second"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
