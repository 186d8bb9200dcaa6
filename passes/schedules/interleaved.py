"""Interleaved 1F1B (Megatron-LM, Narayanan et al., 2021): v chunks per rank, strided stages."""

from pipec.ir import Instr, Op, Schedule, single_pipeline
from pipec.passes.mapping import interleaved as interleaved_mapping
from pipec.passes.mapping import stage_ranks
from pipec.passes.registry import Request, schedule
from pipec.passes.schedules.common import one_f_one_b


def _check(req: Request) -> str | None:
    if req.v < 2:
        return f"--chunks must be at least 2 (got {req.v}); use 1f1b for one chunk per rank"
    if req.m % req.p:
        return (
            f"--microbatches {req.m} must be a multiple of --pp {req.p} "
            f"(Megatron's order runs micro-batches in groups of p); try {req.m + (-req.m) % req.p}"
        )
    return None


@schedule(
    "interleaved",
    "Megatron interleaved 1F1B: v chunks per rank (stage s on rank s mod p), m a multiple of p",
    default_v=2,
    chunks=">= 2",
    checks=(_check,),
)
def interleaved(req: Request) -> Schedule:
    p, m, v = req.p, req.m, req.v
    layout = single_pipeline(p, m, stage_ranks(interleaved_mapping, p * v, p))

    def unit(r: int, k: int, backward: bool) -> tuple[int, int]:
        """(stage, mb) of rank r's k-th virtual micro-batch: groups of p micro-batches walk
        through the chunks in turn (backwards from the last chunk)."""
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk * p + r, (k // (p * v)) * p + k % p

    orders = []
    for r in range(p):
        forwards = [Instr(Op.F, *unit(r, k, False)) for k in range(m * v)]
        backwards = [Instr(Op.BW, *unit(r, k, True)) for k in range(m * v)]
        orders.append(tuple(one_f_one_b(forwards, backwards, warmup=2 * (p - 1 - r) + (v - 1) * p)))
    return Schedule("interleaved", p, m, v, layout, tuple(orders))
