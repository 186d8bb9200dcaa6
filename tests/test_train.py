"""Training for real, in ONE torchrun launch of tests/train_worker.py (4 ranks, gloo).

The factory's data reaches the ranks that hold a first or last stage and no other, and its
targets (which depend on the inputs) train to a loss synthetic batches cannot reach. A run
saved at step 3 and resumed gives steps 4-6 the losses of the uninterrupted run: for 1f1b,
for v-half, resharded into a p=2 x 2 data-parallel build of another schedule, and from a
bidirectional build (two replicas, one saved) into 1f1b. The plain model loaded with
`load_full` gives the pipelined model's loss. The model ties its embedding and head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipec import checkpoint
from pipec.model import compile_model
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train_worker.py"
DATA, SYNTHETIC = (f"{ROOT}/tests/train_factories.py:{f}" for f in ("copying", "synthetic"))
P, M, LR, LEARN_STEPS = 4, 8, 3e-3, 30

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    ck = {name: tmp / f"ck-{name}" for name in ("1f1b", "v-half", "chimera")}
    builds = {f: compile_model(DATA, f, P, M) for f in ("1f1b", "v-half", "chimera")}
    builds["p2-dp2"] = compile_model(DATA, "gpipe", 2, M // 2, dp=2)
    builds["synthetic"] = compile_model(SYNTHETIC, "1f1b", P, M)

    def run(build: str, steps=6, lr=LR, save=None, resume=None, full=False):
        resume = str(checkpoint.step_dir(ck[resume], 3)) if resume else None
        extra = {"steps": steps, "lr": lr, "save": save and str(ck[save]), "every": 3}
        return builds[build], extra | {"resume": resume, "full_loss": resume if full else None}

    cases = {
        "1f1b": run("1f1b", save="1f1b"),
        "1f1b-resumed": run("1f1b", resume="1f1b", full=True),
        "v-half": run("v-half", save="v-half"),
        "v-half-resumed": run("v-half", resume="v-half", full=True),
        "p2-dp2-resumed": run("p2-dp2", resume="1f1b"),
        "chimera": run("chimera", save="chimera"),
        "chimera-to-1f1b": run("1f1b", resume="chimera"),
        "learn/data": run("1f1b", LEARN_STEPS, 1e-2),
        "learn/synthetic": run("synthetic", LEARN_STEPS, 1e-2),
    }
    launched = launch(cases, P, tmp, timeout=420, script=WORKER)
    return launched.results, ck


def losses(results, name: str) -> torch.Tensor:
    return torch.tensor(results[0][name]["losses"], dtype=torch.float64)


@pytest.mark.parametrize(
    "resumed, uninterrupted",
    [
        ("1f1b-resumed", "1f1b"),
        ("v-half-resumed", "v-half"),
        ("p2-dp2-resumed", "1f1b"),
        ("chimera-to-1f1b", "chimera"),
    ],
)
def test_a_resumed_run_continues_the_uninterrupted_one(runs, resumed, uninterrupted):
    results, _ = runs
    assert results[0][resumed]["start"] == 3
    assert len(results[0][resumed]["losses"]) == 3
    torch.testing.assert_close(losses(results, resumed), losses(results, uninterrupted)[3:])


def test_schedules_agree_before_any_checkpoint(runs):
    """The uninterrupted runs are one computation: the comparisons above compare like with like."""
    results, _ = runs
    for other in ("v-half", "chimera"):
        torch.testing.assert_close(losses(results, other), losses(results, "1f1b"))


@pytest.mark.parametrize("name", ["1f1b-resumed", "v-half-resumed"])
def test_load_full_gives_the_plain_model_the_pipelined_loss(runs, name):
    results, _ = runs
    res = results[0][name]
    torch.testing.assert_close(res["full_loss"], res["losses"][0])


def test_checkpoints_on_disk(runs):
    _, ck = runs
    for directory in ck.values():
        assert [p.name for p in checkpoint.checkpoints(directory)] == [
            "step_000003",
            "step_000006",
        ]
        assert not [p for p in directory.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "name, readers",
    [("1f1b", {0, 3}), ("v-half", {0}), ("chimera", {0, 3}), ("p2-dp2-resumed", {0, 1, 2, 3})],
)
def test_only_ranks_with_a_first_or_last_stage_read_data(runs, name, readers):
    results, _ = runs
    assert {r for r, res in enumerate(results) if res[name]["read"]} == readers


def test_data_whose_targets_follow_the_inputs_trains_below_what_synthetic_reaches(runs):
    """Copying needs each target beside its own inputs (the first and last ranks read the same
    micro-batch); synthetic targets can only be memorised, which is slower."""
    results, _ = runs
    data, synthetic = losses(results, "learn/data"), losses(results, "learn/synthetic")
    assert data[-1] < 0.3 * synthetic[-1], (data.tolist(), synthetic.tolist())
