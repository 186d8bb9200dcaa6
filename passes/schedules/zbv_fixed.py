"""torch.distributed.pipelining's ZB-V order (`ScheduleZBVZeroBubble`, torch 2.13), in pure Python.

The paper's ZB-V written out for equal F, B and W costs (Qi et al., ICLR 2024, section 6): rank
r warms up with 2(p-r)-1 chunk-0 forwards, then r pairs f F, then p-r groups f B W; the steady
phase repeats F b w f B W; the cool-down runs r pairs b B, then p-r pairs b w, then the weight
passes left (W before w). torch builds it for max(m, 2p-1) micro-batches and drops the spare
ones. It is a peer's order for the V placement at 1F1B's memory (p stashes), so the V
families with that much memory consider it beside their own. Pass names are vblocks'.
"""

from __future__ import annotations

from pipec.passes.schedules.vblocks import Orders, first_of


def zbv_orders(p: int, m: int) -> Orders:
    """torch's ZBVZeroBubble order of every rank for p ranks and m micro-batches."""
    return [_rank(p, m, r) for r in range(p)]


def _rank(p: int, m: int, r: int) -> list[str]:
    n = max(2 * p - 1, m)
    row = ["F"] * (2 * (p - r) - 1) + ["f", "F"] * r + ["f", "B", "W"] * (p - r)
    f0, f1 = 2 * (p - r) - 1 + r, p
    while f1 < f0 or f0 < n:
        if f0 < n:
            row.append("F")
            f0 += 1
        row += ["b", "w", "f", "B", "W"]
        f1 += 1
    row += ["b", "B"] * r + ["b", "w"] * (p - r)
    row += ["W"] * r + ["w"] * r  # the weight passes the cool-down left, chunk 1's first
    return first_of(row, m)
