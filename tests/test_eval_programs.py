"""Evaluation programs: every family's forward-only programs verify; a model build writes them,
`pipec verify` checks them, and the verifier refuses a broken one."""

from dataclasses import replace
from pathlib import Path

import pytest

from passes.forward_only import FORWARD_OPS, forward_only, verify_forward
from passes.registry import SCHEDULES, family
from passes.verify import VerifyError
from pipec.build_dir import check_build, emit, eval_file, load
from pipec.ir import Instr, Op, PipecError
from pipec.model import compile_model
from tests.helpers import run

family("1f1b")  # registers the built-in families
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"v-adaptive"}))
def test_every_family_has_a_verified_forward_pass(name):
    fam = SCHEDULES[name]
    for p, m in ((2, 4), (4, 8)):
        try:
            result = run(name, p, m, fam.default_v)
        except PipecError:
            continue  # a shape the family refuses
        evaluation = forward_only(result.compiled.programs)
        verify_forward(replace(result.compiled, programs=evaluation))
        for prog, train in zip(evaluation, result.compiled.programs):
            assert prog == tuple(i for i in train if i.op in FORWARD_OPS)


def test_the_verifier_refuses_a_broken_forward_pass():
    c = run("1f1b", 2, 4, 1).compiled
    good = forward_only(c.programs)

    def check(programs):
        verify_forward(replace(c, programs=tuple(programs)))

    with pytest.raises(VerifyError, match="F s=0 mb=3 is missing"):
        check([good[0][:-2], good[1]])  # its last F and SEND_ACT gone
    with pytest.raises(VerifyError, match="not a forward or activation message"):
        check([good[0] + (Instr(Op.OPTIMIZER_STEP),), good[1]])
    with pytest.raises(VerifyError, match="needs F s=0 mb=0, not received"):
        check([good[0], good[1][1:] + good[1][:1]])  # rank 1 receives mb 0 last


def test_a_model_build_writes_and_verifies_its_evaluation_programs(tmp_path):
    out = tmp_path / "build"
    emit(compile_model(f"{ROOT}/examples/gpt.py:tiny", "zb-v", 2, 4), out)
    build = load(out)
    assert len(build.eval_programs) == 2
    check_build(build)
    f = out / eval_file(0)  # V-shape: rank 0 holds stages 0 and 3
    lines = f.read_text().splitlines()
    f.write_text("\n".join(line for line in lines if not line.startswith("F s=3 ")) + "\n")
    with pytest.raises(PipecError, match="F s=3 mb=0 is missing"):
        check_build(load(out))
    f.unlink()
    with pytest.raises(PipecError, match="eval_rank_000.pipe: missing"):
        load(out)
