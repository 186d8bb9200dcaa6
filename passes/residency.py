"""Where each stash lives: the verifier's check of BPipe's stash moves, rank by rank.

A stash is made by F on its stage's rank and read by the first backward-side op of that
(stage, mb): RECOMPUTE, B or BW. Between the two the evictor may EVICT it (to an acceptor) and
must LOAD it back before that read: a stash is never used while evicted, an EVICT is loaded
back exactly once, and only a stash that F made and nothing has read yet can be evicted (what
B leaves for W stays put). On the acceptor every ACCEPTed stash is held until its RETURN, and
nothing is held at the end. That the halves match across ranks, in a deadlock-free order, is
`check_execution`'s part; that the acceptor stays within the limit, `check_memory`'s (in
stashes) or `check_stash_bytes`'s (a limit in bytes, with a model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipec.ir import MEMORY_OPS, Compiled, Op, PipecError, op_kinds
from pipec.passes.violation import VerifyError, at

if TYPE_CHECKING:
    from pipec.passes.simulate import SimResult

NEEDS_MODEL = (
    "a --memory-limit in bytes needs a MODEL (path/to/file.py:factory) to measure stash bytes; "
    "without one give stashes per rank, e.g. --memory-limit 5"
)

_READS = frozenset({Op.RECOMPUTE, Op.B, Op.BW, Op.W})


def check_residency(compiled: Compiled) -> None:
    """Raise VerifyError unless every stash move on every rank is well placed."""
    if MEMORY_OPS.isdisjoint(op_kinds(compiled.programs)):
        return  # no stash moves: nothing below can fail (every check involves a move)
    for r, prog in enumerate(compiled.programs):
        made: set[tuple[int, int]] = set()  # F ran; nothing has read the stash yet
        evicted: dict[tuple[int, int], int] = {}  # stash -> position of its EVICT
        held: dict[tuple[int, int], int] = {}  # accepted stash -> position of its ACCEPT
        for pos, instr in enumerate(prog):
            key, op = (instr.stage, instr.mb), instr.op
            if op is Op.F:
                made.add(key)
            elif op in _READS:
                if key in evicted:
                    raise VerifyError(
                        f"{at(r, pos, instr)}: uses the stash while it is evicted "
                        f"(EVICT at instruction {evicted[key]}, no LOAD before this)"
                    )
                made.discard(key)
            elif op is Op.EVICT:
                if key not in made or key in evicted:
                    raise VerifyError(
                        f"{at(r, pos, instr)}: evicts a stash that is not here "
                        "(F has not run, it was already read, or it is evicted)"
                    )
                evicted[key] = pos
            elif op is Op.LOAD:
                if evicted.pop(key, None) is None:
                    raise VerifyError(f"{at(r, pos, instr)}: loads a stash that is not evicted")
            elif op is Op.ACCEPT:
                if key in held:
                    raise VerifyError(f"{at(r, pos, instr)}: accepts a stash it already holds")
                held[key] = pos
            elif op is Op.RETURN and held.pop(key, None) is None:
                raise VerifyError(f"{at(r, pos, instr)}: returns a stash it does not hold")
        for what, left in (("EVICT", evicted), ("ACCEPT", held)):
            if left:
                (s, mb), pos = min(left.items(), key=lambda kv: kv[1])
                undo = "never loaded back" if what == "EVICT" else "never returned"
                raise VerifyError(
                    f"rank {r}, instruction {pos} ({what} s={s} mb={mb}): {undo} "
                    f"({len(left)} such on this rank)"
                )


def check_stash_bytes(sim: SimResult, limit: float) -> None:
    """A limit in bytes: every rank's simulated peak of stash bytes (each stash weighing its
    stage's measured bytes, on whichever rank holds it) is within `limit`."""
    for r, rank in enumerate(sim.ranks):
        if rank.peak_stash_bytes is None:
            raise PipecError(NEEDS_MODEL)
        if rank.peak_stash_bytes > limit + 0.5:  # the simulator rounds to whole bytes
            raise VerifyError(
                f"rank {r}: {rank.peak_stash_bytes}B of stash live at its peak, over the limit "
                f"{limit:.0f}B; raise --memory-limit or add --evict"
            )
