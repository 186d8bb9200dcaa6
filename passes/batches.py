"""Message batches: which of a rank's messages an NCCL run issues together.

NCCL matches point-to-point messages in issue order, per pair of ranks and direction, and
PyTorch issues a lone `isend`/`irecv` on a communicator of the two ranks but the messages of a
`batch_isend_irecv` on the group's communicator. Two communicators between the same ranks
keep separate orders, so a message sent on one could be matched with nothing or with the wrong
receive on the other. An NCCL run therefore issues every message through
`batch_isend_irecv`, a batch per entry of `message_batches`, in program order: one
communicator, one order, and the messages of one batch progress together (a send and a
receive to the same peer run in both directions at once instead of one after the other).

A batch is a maximal run of consecutive message instructions of one rank (sends, receives and
stash moves: no compute between them), except that a LOAD or ACCEPT after a move out (EVICT,
RETURN) of the same run starts a new batch: before an instruction that allocates stash bytes
the runtime waits for the rank's moves out to complete (`ALLOCATES`, runtime/offload.py), and a
move out still waiting in the open batch would never complete.

Why this cannot deadlock: the verifier executes the programs with every message blocking both
ranks until its counterpart arrives, one instruction at a time. A batch only lifts the order
among messages with nothing between them; any execution of the verified programs is one of the
batched programs, and matching a message never prevents another from matching, so the batched
programs finish too (docs/gpu.md has the whole argument, NCCL's streams included).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipec.ir import Instr, Op
from pipec.passes.memory_bytes import ALLOCATES
from pipec.passes.rendezvous import MESSAGE_OPS

MOVES_OUT = frozenset({Op.EVICT, Op.RETURN})


def message_batches(program: Sequence[Instr]) -> tuple[tuple[int, ...], ...]:
    """The positions of each batch of `program`, in program order; every message instruction
    is in exactly one, a batch's positions are consecutive and hold message instructions only."""
    batches: list[tuple[int, ...]] = []
    run: list[int] = []
    moved_out = False
    for k, instr in enumerate(program):
        op = instr.op
        if op not in MESSAGE_OPS or (moved_out and op in ALLOCATES):
            if run:
                batches.append(tuple(run))
            run, moved_out = [], False
        if op in MESSAGE_OPS:
            run.append(k)
            moved_out = moved_out or op in MOVES_OUT
    if run:
        batches.append(tuple(run))
    return tuple(batches)


def batch_ends(program: Sequence[Instr]) -> frozenset[int]:
    """Positions after which a batch is complete and issued."""
    return frozenset(batch[-1] for batch in message_batches(program))
