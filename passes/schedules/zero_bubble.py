"""The handcrafted zero-bubble schedules ZB-H1 and ZB-H2 (Qi et al., ICLR 2024).

Both split the backward into B (input gradient, on the critical path) and W (weight gradient,
free to move). ZB-H1 keeps 1F1B's warm-up and memory and lets W lag B by r on rank r, which
fills the cool-down's bubbles with W: bubble (p-1)(F+B-W). ZB-H2 warms up deeper, with
2(p-r)-1 forwards on rank r, and defers W on the last ranks at the tail so that the backward
chain is never delayed: the trapezoid becomes a parallelogram, bubble (p-1)(F+B-2W), at
(2p-2r-1)·M_B + 2r·M_W on rank r.
"""

from pipec.ir import Instr, Op, Schedule, single_pipeline
from pipec.passes.mapping import sequential, stage_ranks
from pipec.passes.registry import Request, schedule
from pipec.passes.schedules.limits import refuse_over_limit


def _sequential_schedule(name: str, req: Request, orders: list[list[Instr]]) -> Schedule:
    layout = single_pipeline(req.p, req.m, stage_ranks(sequential, req.p, req.p))
    sched = Schedule(name, req.p, req.m, 1, layout, tuple(map(tuple, orders)))
    return refuse_over_limit(sched, req, "zb-auto")


def zb_h1_order(p: int, m: int, rank: int) -> list[Instr]:
    """Rank `rank`'s ZB-H1 order: for x = 0 .. m+p-2, F_x, B_(x-(p-1-rank)), W_(x-(p-1))."""
    order = []
    for x in range(m + p - 1):
        for op, mb in ((Op.F, x), (Op.B, x - (p - 1 - rank)), (Op.W, x - (p - 1))):
            if 0 <= mb < m:
                order.append(Instr(op, rank, mb))
    return order


def zb_h2_order(p: int, m: int, rank: int) -> list[Instr]:
    """Rank `rank`'s ZB-H2 order.

    Warm up with 2(p-rank)-1 forwards; then every B is followed by a gap before the next B.
    The first m-2p+1 gaps hold a W and an F (W first: it frees M_W before F adds M_B); the
    last 2p-2 gaps hold one pass, an F while forwards remain, else a W. The W's this leaves
    over run at the tail. With unit costs the B chain then never waits and every rank is busy
    from its first F to its last W.
    """
    warmup = min(m, 2 * (p - rank) - 1)
    order = [Instr(Op.F, rank, mb) for mb in range(warmup)]
    n_f, n_w = warmup, 0
    for k in range(m):
        order.append(Instr(Op.B, rank, k))
        if k == m - 1:
            break
        double = k < m - 2 * p + 1
        if (double or n_f == m) and n_w <= k:
            order.append(Instr(Op.W, rank, n_w))
            n_w += 1
        if n_f < m:
            order.append(Instr(Op.F, rank, n_f))
            n_f += 1
    order += [Instr(Op.W, rank, mb) for mb in range(n_w, m)]
    return order


@schedule("zb-h1", "zero bubble H1: 1F1B's warm-up and memory, W lags B to fill the cool-down")
def zb_h1(req: Request) -> Schedule:
    return _sequential_schedule("zb-h1", req, [zb_h1_order(req.p, req.m, r) for r in range(req.p)])


@schedule("zb-h2", "zero bubble H2: 2(p-r)-1 warm-up forwards, W deferred to the tail; ~2x memory")
def zb_h2(req: Request) -> Schedule:
    return _sequential_schedule("zb-h2", req, [zb_h2_order(req.p, req.m, r) for r in range(req.p)])
