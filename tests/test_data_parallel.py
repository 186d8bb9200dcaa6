"""Data-parallel gradient sync: the verifier requires one ALLREDUCE_GRADS per stage after its
last backward op when the build has --dp copies, and none without (a missing or early sync
lets each copy train on its own share of the batch, which no other check would notice)."""

from __future__ import annotations

import pytest

from pipec.compile import compile_schedule
from pipec.ir import Compiled, Op
from pipec.passes.costs import CostModel
from pipec.passes.verify import VerifyError, verify


def _dp_build(schedule: str = "1f1b", dp: int = 2) -> Compiled:
    return compile_schedule(schedule, 4, 8, dp=dp).compiled


def _edit(c: Compiled, rank: int, program) -> Compiled:
    programs = list(c.programs)
    programs[rank] = tuple(program)
    return Compiled(c.schedule, c.p, c.m, c.v, c.layout, tuple(programs))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved", "v-half"])
def test_every_dp_build_verifies_with_its_syncs(schedule):
    c = _dp_build(schedule)
    verify(c, CostModel(), dp=2)
    syncs = [i for prog in c.programs for i in prog if i.op is Op.ALLREDUCE_GRADS]
    assert len(syncs) == c.layout.n_stages


def test_a_missing_sync_is_refused():
    c = _dp_build()
    prog = [i for i in c.programs[1] if i.op is not Op.ALLREDUCE_GRADS]
    with pytest.raises(VerifyError, match="rank 1: stage 1 has no ALLREDUCE_GRADS across its 2"):
        verify(_edit(c, 1, prog), CostModel(), dp=2)


def test_a_duplicated_or_early_sync_is_refused():
    c = _dp_build()
    prog = list(c.programs[0])
    sync = next(k for k, i in enumerate(prog) if i.op is Op.ALLREDUCE_GRADS)
    with pytest.raises(VerifyError, match="appears more than once"):
        verify(_edit(c, 0, prog + [prog[sync]]), CostModel(), dp=2)
    first_backward = next(k for k, i in enumerate(prog) if i.op is Op.BW)
    early = (
        prog[:first_backward]
        + [prog[sync]]
        + [i for k, i in enumerate(prog) if k >= first_backward and k != sync]
    )
    with pytest.raises(VerifyError, match="before the stage's last backward op"):
        verify(_edit(c, 0, early), CostModel(), dp=2)


def test_a_sync_without_dp_is_refused():
    c = _dp_build()
    with pytest.raises(VerifyError, match="a data-parallel sync in a build without --dp"):
        verify(c, CostModel(), dp=1)
