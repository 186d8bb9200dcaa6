"""BPipe's memory ops: EVICT/LOAD on the evictor, ACCEPT/RETURN on the acceptor.

EVICT packs the stash's saved tensors into one flat byte buffer (runtime/stash.py), sends its
size and then the buffer to the acceptor (non-blocking) and drops them here. ACCEPT waits for
the size, then posts the receive of the buffer and holds it. RETURN sends the held buffer back
and forgets it. LOAD posts the receive of the buffer coming back; the backward (or RECOMPUTE)
that needs the stash waits for it and rebuilds the saved tensors. The memory meter counts the
buffer on whichever rank holds it. A forward that will be recomputed kept only its inputs:
those are what EVICT moves, and LOAD brings them back before RECOMPUTE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipec.ir import Instr
from runtime.p2p import Kind
from runtime.stash import SavedTensors, Stash

if TYPE_CHECKING:
    from runtime.rank import Rank


def _stash(rt: Rank, instr: Instr) -> Stash:
    stash = rt.stashes.get((instr.stage, instr.mb))
    if stash is None:
        raise RuntimeError(f"{instr}: no stash of s={instr.stage} mb={instr.mb} here to move")
    return stash


def _moved(stash: Stash) -> SavedTensors:
    """What EVICT moves: autograd's saved tensors, or the inputs of a forward that ran without
    autograd (to be recomputed), held as saved tensors until they are back."""
    if stash.saved is None:
        stash.saved = SavedTensors(frozenset())
        for x in stash.inputs:
            stash.saved.pack(x)
        stash.inputs = ()
    return stash.saved


def evict(rt: Rank, instr: Instr) -> None:
    stash = _stash(rt, instr)
    buffer = _moved(stash).evict()
    stash.evicted_size = buffer.numel()
    size = torch.tensor([buffer.numel()], dtype=torch.int64, device=rt.device)
    rt.comm.send(Kind.STASH_SIZE, instr.stage, instr.mb, instr.peer, [size])
    rt.comm.send(Kind.STASH, instr.stage, instr.mb, instr.peer, [buffer])
    rt.account(-stash.saved.nbytes)


def accept(rt: Rank, instr: Instr) -> None:
    s, mb = instr.stage, instr.mb
    size = torch.empty(1, dtype=torch.int64, device=rt.device)
    rt.comm.post(Kind.STASH_SIZE, s, mb, instr.peer, [size])
    n = int(rt.comm.take(Kind.STASH_SIZE, s, mb)[0].item())
    buffer = torch.empty(n, dtype=torch.uint8, device=rt.device)
    rt.comm.post(Kind.STASH, s, mb, instr.peer, [buffer])
    rt.held[(s, mb)] = n
    rt.account(n)


def give_back(rt: Rank, instr: Instr) -> None:
    """RETURN: send the held stash of (s, mb) back to its evictor."""
    s, mb = instr.stage, instr.mb
    buffer = rt.comm.take(Kind.STASH, s, mb)[0]
    rt.comm.send(Kind.STASH_BACK, s, mb, instr.peer, [buffer])
    rt.account(-rt.held.pop((s, mb)))


def load(rt: Rank, instr: Instr) -> None:
    stash = _stash(rt, instr)
    buffer = torch.empty(stash.evicted_size, dtype=torch.uint8, device=rt.device)
    rt.comm.post(Kind.STASH_BACK, instr.stage, instr.mb, instr.peer, [buffer])
    stash.loading = True
    rt.account(stash.saved.nbytes)


def finish_load(rt: Rank, stage: int, mb: int, stash: Stash) -> None:
    """Wait for a loaded stash and rebuild its saved tensors (before their first use)."""
    stash.saved.restore(rt.comm.take(Kind.STASH_BACK, stage, mb)[0])
    stash.loading = False
    if stash.outputs is None:  # not recomputed yet: what came back are its inputs
        stash.inputs = tuple(h.tensor for h in stash.saved.handles)
        stash.saved = None
