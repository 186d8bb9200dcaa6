"""What the verifier raises, and how it names the place: shared by the invariant checks."""

from __future__ import annotations

from pipec.ir import Instr, PipecError


class VerifyError(PipecError):
    """A program breaks one of the invariants; the message says where and why."""


def at(rank: int, pos: int, instr: Instr) -> str:
    """Where a violation is: rank, position in its program, and the instruction."""
    return f"rank {rank}, instruction {pos} ({instr})"
