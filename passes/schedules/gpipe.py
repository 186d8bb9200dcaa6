"""GPipe: every forward, then every backward (Huang et al., 2019)."""

from pipec.ir import Instr, Op, Schedule, single_pipeline
from pipec.passes.mapping import sequential, stage_ranks
from pipec.passes.registry import Request, schedule


@schedule("gpipe", "all forwards, then all backwards; m stashes on every rank")
def gpipe(req: Request) -> Schedule:
    layout = single_pipeline(req.p, req.m, stage_ranks(sequential, req.p, req.p))
    orders = tuple(
        tuple(Instr(op, r, i) for op in (Op.F, Op.BW) for i in range(req.m)) for r in range(req.p)
    )
    return Schedule("gpipe", req.p, req.m, 1, layout, orders)
