"""Evaluation programs: every family's forward-only programs verify; a model build writes them,
`pipec verify` checks them, and the verifier refuses a broken one; one rank evaluates in
process and leaves no trace (the two-rank run is tests/test_train_metrics.py)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipec.build_dir import check_build, emit, eval_file, load
from pipec.frontend import load_factory
from pipec.ir import Instr, Op, PipecError
from pipec.model import compile_model
from pipec.passes.forward_only import FORWARD_OPS, forward_only, verify_forward
from pipec.passes.registry import SCHEDULES, family
from pipec.passes.verify import VerifyError
from pipec.runtime.evaluate import evaluate
from pipec.runtime.faults import Watchdog
from pipec.runtime.rank import Rank
from tests.helpers import run
from tests.train_factories import held_out

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


def test_evaluation_in_one_process_restores_what_it_touched(tmp_path):
    """Interleaved at p=1 (two stages on one rank: a local hand-off): the evaluation loss is
    the plain model's on eval_data's batches, and the rank comes back as it was: train mode,
    its program and data, and torch's random state."""
    spec, m = f"{ROOT}/tests/train_factories.py:copying_with_eval", 2
    emit(compile_model(spec, "interleaved", 1, m), tmp_path / "b")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rt = Rank.prepare(load(tmp_path / "b"), 0, 1, torch.device("cpu"))
        rt.connect(lambda ps: torch.optim.AdamW(ps), 30)
        program, data, rng = rt.program, rt.data, torch.get_rng_state()
        with Watchdog(30, rt.describe) as watchdog:
            loss = evaluate(rt, 3, watchdog)
    finally:
        dist.destroy_process_group()
    assert rt.program is program and rt.data is data and not rt.step_state.losses
    assert all(module.training for module in rt.modules.values())
    assert torch.equal(torch.get_rng_state(), rng)
    plain = load_factory(spec)
    plain.model.eval()
    rows = m * plain.example_inputs[0].shape[0]
    with torch.no_grad():
        losses = [
            plain.loss_fn(plain.model(xi), yi).item()
            for ((x,), y), _ in zip(held_out(rows, 0), range(3))
            for xi, yi in zip(x.chunk(m), y.chunk(m))
        ]
    assert loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)
