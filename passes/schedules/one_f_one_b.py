"""1F1B (PipeDream-Flush / DAPPLE) and its full-recompute variant."""

from pipec.ir import Instr, Op, Schedule, single_pipeline
from pipec.passes.mapping import sequential, stage_ranks
from pipec.passes.registry import Request, schedule
from pipec.passes.schedules.common import one_f_one_b


def _orders(p: int, m: int, recompute: bool) -> tuple[tuple[Instr, ...], ...]:
    orders = []
    for r in range(p):
        forwards = [Instr(Op.F, r, i) for i in range(m)]
        backwards = [Instr(Op.BW, r, i) for i in range(m)]
        order = one_f_one_b(forwards, backwards, warmup=p - 1 - r)
        if recompute:
            order = [
                x
                for i in order
                for x in ([Instr(Op.RECOMPUTE, r, i.mb), i] if i.op is Op.BW else [i])
            ]
        orders.append(tuple(order))
    return tuple(orders)


@schedule("1f1b", "warm up p-1-r forwards, then one forward one backward; rank r stashes p-r")
def onef1b(req: Request) -> Schedule:
    layout = single_pipeline(req.p, req.m, stage_ranks(sequential, req.p, req.p))
    return Schedule("1f1b", req.p, req.m, 1, layout, _orders(req.p, req.m, recompute=False))


@schedule(
    "1f1b-r",
    "1F1B with full recompute: stash only stage inputs, RECOMPUTE before each backward",
)
def onef1b_recompute(req: Request) -> Schedule:
    layout = single_pipeline(req.p, req.m, stage_ranks(sequential, req.p, req.p))
    return Schedule("1f1b-r", req.p, req.m, 1, layout, _orders(req.p, req.m, recompute=True))
