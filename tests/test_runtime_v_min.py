"""V-Min's measured stash against 1F1B's at 8 ranks, where the issue's 0.4x is reachable.

V-Min holds (p+4)//3 micro-batch stashes on its busiest rank and 1F1B p (ALGORITHMS.md); on
rank 0 the schedule keeps one fewer at p=8: 3 of 8 (0.375), 0.39x in bytes with the loss chunk.
At p=4 rank 0 holds 2 of 4, so tests/test_runtime.py cannot show 0.4x and this file runs 8
gloo ranks of the deep, narrow GPT (16 one-layer chunks) in one launch: both schedules train
one step, gradients equal the single-process reference, measured peak stash bytes match the
simulator's on every rank, and rank 0's ratio is at most 0.4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipec.model import compile_model
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
DEEP = f"{ROOT}/examples/gpt.py:deep"
P, M = 8, 16
FAMILIES = ("1f1b", "v-min")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    cases = {f: (compile_model(DEEP, f, P, M), {"kind": "grads"}) for f in FAMILIES}
    return cases, launch(cases, P, tmp_path_factory.mktemp("v_min"), timeout=300).results


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_and_measured_peaks_match(launched, name):
    cases, results = launched
    sim = cases[name][0].sim
    for rank, res in enumerate(results):
        assert res[name]["ok"], f"rank {rank}: {res[name]['error']}"
        predicted = sim.ranks[rank].peak_stash_bytes
        measured = res[name]["peak_stash_bytes"]
        assert abs(measured - predicted) <= 0.10 * predicted, (rank, measured, predicted)


def test_v_min_rank_0_holds_at_most_0_4x_of_1f1b(launched):
    cases, results = launched
    assert [cases[f][0].sim.ranks[0].peak_activations for f in FAMILIES] == [P, (P + 4) // 3 - 1]
    v_min, one_f = (results[0][f]["peak_stash_bytes"] for f in ("v-min", "1f1b"))
    assert v_min <= 0.4 * one_f, v_min / one_f
