"""DualPipe and DualPipeV (DeepSeek-V3 technical report; deepseek-ai/DualPipe).

Every rank holds two stages. In DualPipe they belong to two model replicas running in
opposite directions over p ranks (2x parameters, gradients all-reduced between rank r and
p-1-r at the end); in DualPipeV they are the two legs of a V over p ranks (one model copy,
the DualPipe of 2p ranks folded in half). Call the stage at position h of its pipeline
"phase 0" and the one at position 2·half-1-h "phase 1" (h = the rank's position among `half`
ranks); then both variants run the same eight steps, taken from the reference code (its `step`):

  1. (half-h-1)·2 F0    2. h+1 × (F0 F1)    3. half-h-1 × (B1 W F1), B/W split
  4. n-2·half+h+1 × (F0&B1 F1&B0), the F&B pairs (the middle rank's first F0, B1 apart)
  5. half-h-1 × (B1 F1&B0)    6. h+1 × (B1 B0), the later half with B/W split
  7. half-h-1 × (W B0), split    8. h+1 × W

with n micro-batches per pipeline. A full backward is one fused BW (input and weight gradients
in one pass, as the reference runs it: its input gradient leaves when both are done); a split
one is B now and its W queued, each W step running the oldest queued one. An F&B pair is
`OVERLAP` then the forward and the full backward. The reference overlaps the two; pipec's
runtime does not: it runs the forward, then the backward, each once its own input is in, and
the simulator times them so (no speed-up from overlap assumed). DeepSeek's accounting, in
which its bubble is (PP/2-1)(F&B+B-3W) with F&B = F+B+W and B the full backward, starts a
pair once both inputs are in (`simulate(..., overlap_as_one=True)`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from pipec.ir import Instr, Op, Schedule, single_pipeline
from pipec.passes.mapping import stage_ranks, v_shape
from pipec.passes.registry import Request, only_v, schedule
from pipec.passes.replicas import syncs_at_end
from pipec.passes.schedules.bidirectional import even_p, two_way_layout

Step = tuple[str, int, int]
"""("F", phase, 0), ("B", phase, split), ("W", 0, 0) or ("FB", forward phase, backward phase)."""


def dual_steps(half: int, h: int, n: int) -> Iterator[Step]:
    """The eight steps above for the rank at position h of `half`, n micro-batches each way."""
    yield from [("F", 0, 0)] * ((half - h - 1) * 2)
    for _ in range(h + 1):
        yield from [("F", 0, 0), ("F", 1, 0)]
    for _ in range(half - h - 1):
        yield from [("B", 1, 1), ("W", 0, 0), ("F", 1, 0)]
    for i in range(n - 2 * half + h + 1):
        if i == 0 and h == half - 1:  # apart, to shorten the middle ranks' bubble
            yield from [("F", 0, 0), ("B", 1, 0)]
        else:
            yield ("FB", 0, 1)
        yield ("FB", 1, 0)
    for _ in range(half - h - 1):
        yield from [("B", 1, 0), ("FB", 1, 0)]
    split = 0
    for i in range(h + 1):
        split |= i == (h + 1) // 2 and h % 2 == 1
        yield ("B", 1, split)
        split |= i == (h + 1) // 2 and h % 2 == 0
        yield ("B", 0, split)
    for _ in range(half - h - 1):
        yield from [("W", 0, 0), ("B", 0, 1)]
    yield from [("W", 0, 0)] * (h + 1)


def dual_order(
    steps: Iterator[Step], stages: tuple[int, int], mbs: Sequence[Sequence[int]]
) -> list[Instr]:
    """One rank's order: phase k is `stages[k]` over micro-batches `mbs[k]`, taken in turn."""
    nxt = {(kind, ph): 0 for kind in "FB" for ph in (0, 1)}
    queued: deque[Instr] = deque()
    order: list[Instr] = []

    def take(kind: str, ph: int) -> int:
        nxt[(kind, ph)] += 1
        return mbs[ph][nxt[(kind, ph)] - 1]

    def backward(ph: int, split: int) -> Instr:
        mb = take("B", ph)
        if not split:
            return Instr(Op.BW, stages[ph], mb)
        queued.append(Instr(Op.W, stages[ph], mb))
        return Instr(Op.B, stages[ph], mb)

    for kind, a, b in steps:
        if kind == "F":
            order.append(Instr(Op.F, stages[a], take("F", a)))
        elif kind == "B":
            order.append(backward(a, b))
        elif kind == "W":
            order.append(queued.popleft())
        else:
            order += [Instr(Op.OVERLAP), Instr(Op.F, stages[a], take("F", a)), backward(b, 0)]
    return order


def _check_dualpipe(req: Request) -> str | None:
    if req.m % 2 or req.m < 2 * req.p:
        return (
            f"--microbatches {req.m} must be even and at least 2·pp = {2 * req.p} (half flow "
            f"each way, at least pp per direction); try {max(2 * req.p, req.m + req.m % 2)}"
        )
    return None


def _check_dualpipev(req: Request) -> str | None:
    if req.m < 2 * req.p:
        return (
            f"--microbatches {req.m} must be at least 2·pp = {2 * req.p} "
            f"(the V has 2·pp stages); try {2 * req.p}"
        )
    return None


@schedule(
    "dualpipe",
    "DeepSeek DualPipe: two replicas in opposite directions, F&B pairs (run as F then B, "
    "not overlapped); even p, even m >= 2p",
    checks=(only_v(1), even_p, _check_dualpipe),
)
def dualpipe(req: Request) -> Schedule:
    p, m = req.p, req.m
    layout = two_way_layout(p, m, tuple(range(p)))
    orders = []
    for r in range(p):
        h = min(r, p - 1 - r)
        down, up = r, 2 * p - 1 - r  # this rank's stage in each pipeline
        stages = (down, up) if r < p // 2 else (up, down)  # phase 0 is the one at position h
        mbs = [layout.pipelines[layout.pipeline_of_stage(s)].mbs for s in stages]
        orders.append(dual_order(dual_steps(p // 2, h, m // 2), stages, mbs))
    return Schedule("dualpipe", p, m, 1, layout, syncs_at_end(layout, orders))


@schedule(
    "dualpipev",
    "DeepSeek DualPipeV: DualPipe folded into a V over p ranks (one model copy); m >= 2p",
    default_v=2,
    chunks="2",
    checks=(only_v(2), _check_dualpipev),
)
def dualpipev(req: Request) -> Schedule:
    p, m = req.p, req.m
    layout = single_pipeline(p, m, stage_ranks(v_shape, 2 * p, p))
    orders = tuple(
        tuple(dual_order(dual_steps(p, r, m), (r, 2 * p - 1 - r), [range(m)] * 2)) for r in range(p)
    )
    return Schedule("dualpipev", p, m, 2, layout, orders)
