"""Export: pipec programs as torch.distributed.pipelining actions, compute-only or with comms.

Expects a verified `Compiled`; guarantees one row of actions per rank that torch's
`_PipelineScheduleRuntime` can load: F -> F, BW -> B (full backward), B -> I (input backward),
W -> W; with comms, SEND_ACT/RECV_ACT -> SEND_F/RECV_F and SEND_GRAD/RECV_GRAD -> SEND_B/RECV_B
in pipec's (deadlock-free) order, and OPTIMIZER_STEP -> one REDUCE_GRAD per stage of the rank
(torch scales gradients there and steps the optimizer outside the schedule; its compute-only
loader adds REDUCE_GRAD itself); an OVERLAP hint is dropped (torch runs the pair in turn).
Anything torch's runtime cannot run is refused, by name.
"""

from __future__ import annotations

from pipec.ir import Compiled, Instr, Op, PipecError
from pipec.torch_csv import Action, Cell

COMPUTE_TYPE = {Op.F: "F", Op.BW: "B", Op.B: "I", Op.W: "W"}
COMM_TYPE = {
    Op.SEND_ACT: "SEND_F",
    Op.RECV_ACT: "RECV_F",
    Op.SEND_GRAD: "SEND_B",
    Op.RECV_GRAD: "RECV_B",
}


def check_exportable(compiled: Compiled) -> None:
    """PipecError unless the build is one chain of stages 0..S-1 over one set of ranks."""
    layout = compiled.layout
    chain = tuple(range(layout.n_stages))
    if len(layout.pipelines) != 1 or layout.pipelines[0].stages != chain:
        raise PipecError(
            f"torch's runtime runs one pipeline of stages 0..S-1; this build has "
            f"{len(layout.pipelines)} pipeline(s) over stages "
            f"{' / '.join(str(list(pl.stages)) for pl in layout.pipelines)}"
        )
    if layout.pipelines[0].mbs != tuple(range(compiled.m)):
        raise PipecError("torch's runtime feeds micro-batches 0..m-1 to its one pipeline")
    if layout.n_chunks != layout.n_stages:
        raise PipecError(
            "torch's runtime holds one copy of each model chunk; this build has replicas"
        )
    if compiled.world != layout.p:
        raise PipecError(
            f"this build has {compiled.world} ranks for a {layout.p}-rank pipeline (data "
            "parallel copies); torch's CSV describes one pipeline, export a --dp 1 build"
        )


def _cells(rank: int, pos: int, instr: Instr, compiled: Compiled, comms: bool) -> list[Cell]:
    if instr.op in COMPUTE_TYPE:
        return [(Action(instr.stage, COMPUTE_TYPE[instr.op], instr.mb),)]
    if instr.op in COMM_TYPE:
        return [(Action(instr.stage, COMM_TYPE[instr.op], instr.mb),)] if comms else []
    if instr.op is Op.OPTIMIZER_STEP:
        stages = compiled.layout.stages_of_rank(rank)
        return [(Action(s, "REDUCE_GRAD"),) for s in stages] if comms else []
    if instr.op is Op.OVERLAP:  # a hint only: torch runs the pair one after the other
        return []
    raise PipecError(
        f"rank {rank}, instruction {pos} ({instr}): torch's runtime has no {instr.op.value} "
        "action (it runs F, B, I, W, point-to-point and REDUCE_GRAD); export a schedule "
        f"without {instr.op.value}"
    )


def torch_rows(compiled: Compiled, comms: bool) -> list[list[Cell]]:
    """One row of torch actions per rank (see the module docstring for the mapping)."""
    check_exportable(compiled)
    return [
        [
            cell
            for pos, instr in enumerate(program)
            for cell in _cells(rank, pos, instr, compiled, comms)
        ]
        for rank, program in enumerate(compiled.programs)
    ]
