"""Lowering's placement of messages: a send leaves right after its producer, a receive waits
for its consumer unless a later message in the global order must go out first."""

from collections.abc import Sequence

import pytest

from pipec.ir import COMPUTE_OPS, Instr, Op
from pipec.passes.registry import SCHEDULES, family
from tests.helpers import run

family("1f1b")  # registers the built-in families
SENDS = {Op.SEND_ACT: (Op.F,), Op.SEND_GRAD: (Op.B, Op.BW)}
RECVS = {Op.RECV_ACT: (Op.F,), Op.RECV_GRAD: (Op.B, Op.BW)}
CASES = [(name, p) for name in sorted(SCHEDULES) for p in (2, 4)]


def _consumes(instr: Instr, receive: Instr) -> bool:
    same = (instr.stage, instr.mb) == (receive.stage, receive.mb)
    return same and instr.op in RECVS[receive.op]


def _released_by(program: Sequence[Instr], first: int, last: int) -> bool:
    """Whether the receives program[first..last] are where they must be: right before a send
    or all-reduce (later in the global order), or before a compute op that needs one of them
    (for an OVERLAP marker, one of the two compute ops it pairs)."""
    after = program[last + 1]
    if after.op in SENDS or after.op is Op.ALLREDUCE_GRADS:
        return True
    paired = [i for i in program[last + 2 :] if i.op in COMPUTE_OPS][:2]
    consumers = paired if after.op is Op.OVERLAP else [after]
    return any(_consumes(c, r) for c in consumers for r in program[first : last + 1])


@pytest.mark.parametrize("name, p", CASES)
def test_sends_follow_their_producers_and_receives_wait_only_for_sends(name, p):
    result = run(name, p, 8, None)
    for rank, program in enumerate(result.compiled.programs):
        last_compute: Instr | None = None
        first_recv = 0
        for k, instr in enumerate(program):
            if instr.op in COMPUTE_OPS:
                last_compute = instr
            elif instr.op in SENDS:  # no compute op between a send and its producer
                assert last_compute is not None, (rank, k)
                assert last_compute.op in SENDS[instr.op], (rank, k, last_compute)
                assert (last_compute.stage, last_compute.mb) == (instr.stage, instr.mb)
            elif instr.op in RECVS:
                if k == 0 or program[k - 1].op not in RECVS:
                    first_recv = k
                if program[k + 1].op not in RECVS:
                    assert _released_by(program, first_recv, k), (rank, k, program[k + 1])
