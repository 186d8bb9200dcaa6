"""Stash transfers in the simulator: when an EVICT/ACCEPT or RETURN/LOAD pair moves a stash.

The runtime issues both halves without blocking (an isend, and an irecv into a buffer it
allocates when it reaches the instruction). So a transfer starts once both ranks have reached
their half and the data is there (a RETURN can only send back what its ACCEPT received); it
then takes the link's time for the stash's size. Neither rank waits for it, except that the
evicting rank's next use of a stash after its LOAD waits for the stash to arrive.

The k-th EVICT of (stage, mb) pairs with the k-th ACCEPT of it, the k-th LOAD with the k-th
RETURN, exactly as the verifier matches them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from pipec.ir import Instr, Layout, Op
from pipec.passes.costs import CostModel

#: Which transfer each half belongs to, and the op of its sending half.
_KIND = {Op.EVICT: "evict", Op.ACCEPT: "evict", Op.RETURN: "load", Op.LOAD: "load"}
_SENDS = frozenset({Op.EVICT, Op.RETURN})


@dataclass(frozen=True)
class Transfer:
    """One stash moved between two ranks on the simulated timeline."""

    kind: str
    """'evict' (evictor to acceptor) or 'load' (acceptor back to evictor)."""
    stage: int
    mb: int
    src: int
    dst: int
    start: float
    end: float
    size: float


class Transfers:
    """The simulator's book of stash transfers for one play of the programs."""

    def __init__(self, layout: Layout, costs: CostModel, recompute: bool) -> None:
        self.size = costs.stash_size(recompute) * layout.stash_share
        self.costs = costs
        self.count: dict[tuple[Op, int, int], int] = {}
        self.half: dict[Hashable, tuple[float, int, bool]] = {}
        self.arrival: dict[Hashable, float] = {}
        self.pending: dict[tuple[int, int, int], Hashable] = {}
        self.records: list[Transfer] = []

    def reach(self, rank: int, instr: Instr, t: float) -> Hashable | None:
        """`rank` reaches a memory instruction at time t; the key of a transfer it completes."""
        op, s, mb = instr.op, instr.stage, instr.mb
        n = self.count[(op, s, mb)] = self.count.get((op, s, mb), 0) + 1
        key = (_KIND[op], s, mb, n)
        if op is Op.LOAD:
            self.pending[(rank, s, mb)] = key
        other = self.half.pop(key, None)
        if other is None:
            self.half[key] = (t, rank, op in _SENDS)
            return None
        t0, r0, first_sends = other
        src, dst = (r0, rank) if first_sends else (rank, r0)
        start = max(t0, t)
        if key[0] == "load":  # the acceptor can only return what has arrived
            start = max(start, self.arrival.get(("evict", s, mb, n), start))
        end = start + self.costs.transfer_time(src, dst, self.size)
        self.arrival[key] = end
        self.records.append(Transfer(key[0], s, mb, src, dst, start, end, self.size))
        return key

    def gate(self, rank: int, instr: Instr) -> tuple[Hashable, float | None] | None:
        """For a compute op on a stash this rank LOADed: the load's key and arrival (None: not
        known yet). None when the op's stash was not loaded."""
        key = self.pending.get((rank, instr.stage, instr.mb))
        if key is None:
            return None
        return key, self.arrival.get(key)

    def consume(self, rank: int, instr: Instr) -> None:
        """The op that waited for a loaded stash has started: later ops do not wait again."""
        self.pending.pop((rank, instr.stage, instr.mb), None)
