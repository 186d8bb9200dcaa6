"""The runtime trains: gradients equal a single-process reference for every schedule family,
the loss curve matches, measured stash bytes match the simulator's.

All cases run inside ONE torchrun launch of tests/runtime_harness.py (4 ranks, gloo): the
families come from the registry, so a family registered later is covered without an edit here.
The families eviction composes with also run with `--evict` (BPipe's EVICT/LOAD/ACCEPT/RETURN,
compiled at the smallest feasible limit); a hand-written program exercises replica
ALLREDUCE_GRADS, and --dp exercises data parallelism.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipec.cli import main as pipec_main
from pipec.compile import CompileResult, Options, package
from pipec.frontend import build_model_plan, load_factory
from pipec.ir import Instr, Layout, Op, Pipeline, Schedule
from pipec.model import compile_model, model_costs
from pipec.passes.costs import CostModel
from pipec.passes.lower import lower
from pipec.passes.registry import SCHEDULES, family
from tests.runtime_launch import launch
from tests.test_evict_grid import EVICT_SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
GPT, GPT_TIED, LLAMA = (
    f"{ROOT}/examples/{f}" for f in ("gpt.py:tiny", "gpt.py:tiny_tied", "llama.py:tiny")
)
GPT_FX = f"{ROOT}/tests/frontend_models/fx.py:gpt_tiny"  # the same GPT, captured by torch.fx
P, M = 4, 8
family("1f1b")  # registers the built-in families
FAMILIES = sorted(SCHEDULES)
LLAMA_FAMILIES = ["1f1b", "zb-v", "v-half", "bitpipe"]
EVICT_FAMILIES = [f for f in EVICT_SCHEDULES if f in SCHEDULES]
PEAK_CASES = [f"gpt/{f}" for f in FAMILIES] + [f"gpt/{f}-evict" for f in EVICT_FAMILIES]
BEST = "v-half"  # the loss-curve case (the schedule)
TRAIN_STEPS, TRAIN_LR = 30, 1e-3

pytestmark = pytest.mark.slow


def two_replicas() -> CompileResult:
    """Chimera-like by hand: two pipelines in opposite directions over 4 ranks, each holding a
    replica of the 4 chunks; each stage's gradients summed with its replica's (ALLREDUCE_GRADS)
    right after its last backward, in the one pair order lowering gives them."""
    stage_rank = (0, 1, 2, 3, 3, 2, 1, 0)
    layout = Layout(
        P,
        stage_rank,
        (0, 1, 2, 3) * 2,
        (Pipeline((0, 1, 2, 3), (0, 1, 2, 3)), Pipeline((4, 5, 6, 7), (4, 5, 6, 7))),
    )
    orders = []
    for r in range(P):
        down, up = r, 7 - r
        orders.append(
            tuple(Instr(Op.F, down, i) for i in range(4))
            + tuple(Instr(Op.F, up, i) for i in range(4, 8))
            + tuple(Instr(Op.BW, up, i) for i in range(4, 8))
            + (Instr(Op.ALLREDUCE_GRADS, up, None, stage_rank[(up + 4) % 8]),)
            + tuple(Instr(Op.BW, down, i) for i in range(4))
            + (Instr(Op.ALLREDUCE_GRADS, down, None, stage_rank[(down + 4) % 8]),)
        )
    model = build_model_plan(GPT, 4, v=1, replicas=2, progress=False).to_json()
    costs = model_costs(model, CostModel())
    compiled = lower(Schedule("replicas", P, M, 1, layout, tuple(orders)), costs)
    return package(compiled, Options(costs, model=model))


def build_cases() -> dict[str, tuple[CompileResult, dict]]:
    grads = {"kind": "grads"}
    cases = {f"gpt/{f}": (compile_model(GPT, f, P, M), grads) for f in FAMILIES}
    cases |= {f"llama/{f}": (compile_model(LLAMA, f, P, M), grads) for f in LLAMA_FAMILIES}
    cases["gpt-tied/1f1b"] = (compile_model(GPT_TIED, "1f1b", P, M), grads)
    cases["gpt-fx/zb-h1"] = (compile_model(GPT_FX, "zb-h1", P, M), grads)
    cases["gpt/1f1b-dp2"] = (compile_model(GPT, "1f1b", 2, M // 2, dp=2), grads)
    cases |= {
        f"gpt/{f}-evict": (compile_model(GPT, f, P, M, evict=True), grads) for f in EVICT_FAMILIES
    }
    cases["gpt/replicas"] = (two_replicas(), grads)
    train = {"kind": "train", "steps": TRAIN_STEPS, "lr": TRAIN_LR}
    cases[f"train/{BEST}"] = (compile_model(GPT, BEST, P, M), train)
    return cases


def model_parameter_names(spec: str) -> list[str]:
    model = load_factory(spec).model
    return [n for n, _ in model.named_parameters(remove_duplicate=False)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Compile every case, run them all in one torchrun launch; results per rank and case."""
    cases = build_cases()
    run = launch(cases, P, tmp_path_factory.mktemp("runtime"), timeout=420)
    return cases, run.results, run.stdout, run.builds


def grads_cases() -> list[str]:
    return (
        [f"gpt/{f}" for f in FAMILIES]
        + [f"llama/{f}" for f in LLAMA_FAMILIES]
        + [f"gpt/{f}-evict" for f in EVICT_FAMILIES]
        + ["gpt-tied/1f1b", "gpt-fx/zb-h1", "gpt/1f1b-dp2", "gpt/replicas"]
    )


@pytest.mark.parametrize("case", grads_cases())
def test_gradients_equal_single_process_reference(launched, case):
    _, results, _, _ = launched
    for rank, res in enumerate(results):
        assert res[case]["ok"], f"rank {rank}: {res[case]['error']}"
    # Every parameter of the model was compared, on some rank.
    checked = {n for res in results for n in res[case]["names"]}
    spec = GPT_TIED if "tied" in case else LLAMA if "llama" in case else GPT
    assert checked == set(model_parameter_names(spec))


def test_the_default_capture_is_export_and_fx_stays_an_option(launched):
    cases, _, _, _ = launched
    assert cases["gpt/1f1b"][0].plan["model"]["capture"] == "export"
    assert cases["gpt-fx/zb-h1"][0].plan["model"]["capture"] == "fx"


def test_loss_falls_like_the_single_process_run(launched):
    _, results, _, _ = launched
    res = results[0][f"train/{BEST}"]
    losses, reference = res["losses"], res["reference"]
    assert len(losses) == TRAIN_STEPS
    assert losses[-1] < 0.8 * losses[0], losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", PEAK_CASES)
def test_measured_peak_stash_bytes_match_the_simulator(launched, case):
    cases, results, _, _ = launched
    sim = cases[case][0].sim
    for rank, res in enumerate(results):
        predicted = sim.ranks[rank].peak_stash_bytes
        measured = res[case]["peak_stash_bytes"]
        assert abs(measured - predicted) <= 0.10 * predicted, (rank, measured, predicted)


def test_evicted_stashes_live_on_the_acceptor(launched):
    cases, results, _, _ = launched
    stash0 = cases["gpt/1f1b"][0].costs.stash_bytes[0]
    plain = [res["gpt/1f1b"]["peak_stash_bytes"] for res in results]
    evict = [res["gpt/1f1b-evict"]["peak_stash_bytes"] for res in results]
    # 1F1B's rank 0 holds 4 stashes at its peak; held to the balanced bound ceil((p+1)/2) = 3,
    # it evicts to rank 3, which holds one accepted stash at a time beside its own one.
    assert cases["gpt/1f1b-evict"][0].plan["memory_limit"] == 3
    assert plain[0] == 4 * stash0 and evict[0] == 3 * stash0
    assert stash0 <= evict[3] - plain[3] <= 1.01 * stash0  # the flat buffer aligns storages


def test_measured_timeline_and_show(launched, capsys):
    """The run wrote OUT/measured/ in the simulated timeline's format; `pipec show` prints it."""
    _, results, stdout, dirs = launched
    build = dirs[f"train/{BEST}"]
    simulated = json.loads((build / "timeline.json").read_text())
    measured = json.loads((build / "measured/timeline.json").read_text())
    spans = [e for e in measured["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(e["ph"] == "X" for e in simulated["traceEvents"])
    assert {k for e in spans for k in e} == {
        k for e in simulated["traceEvents"] if e["ph"] == "X" for k in e
    }
    stats = json.loads((build / "measured/stats.json").read_text())
    assert stats["steps"] == TRAIN_STEPS and 0 <= stats["measured"]["bubble"] < 1
    assert [r["peak_stash_bytes"] for r in stats["ranks"]] == [
        res[f"train/{BEST}"]["peak_stash_bytes"] for res in results
    ]
    assert "measured over" in stdout and "makespan / replay x" in stdout
    assert all(0 < s["replay_ms"] for s in stats["per_step"])
    pipec_main(["show", str(build), "--lines", "2"])
    out = capsys.readouterr().out
    assert "measured over 29 steps" in out and "stash counter" in out
    assert "predicted (by term) vs measured real" in out


def test_v_min_rank_0_holds_half_of_1f1b_at_4_ranks(launched):
    """At p=4 V-Min's rank 0 holds (p+4)//3 = 2 stashes to 1F1B's 4 (0.53x in bytes: its loss
    chunk's stash is larger), so the issue's 0.4x is shown at 8 ranks: test_runtime_v_min.py."""
    cases, results, _, _ = launched
    stashes = [cases[f"gpt/{f}"][0].sim.ranks[0].peak_activations for f in ("1f1b", "v-min")]
    assert stashes == [P, (P + 4) // 3]
    ratio = results[0]["gpt/v-min"]["peak_stash_bytes"] / results[0]["gpt/1f1b"]["peak_stash_bytes"]
    theory = ((P + 4) // 3) / P
    assert theory <= ratio <= 1.1 * theory, ratio
