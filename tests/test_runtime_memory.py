"""Real memory, tiny GPT at p=4 (gloo, one launch): every schedule's real peak bytes per rank
within 10% of the prediction, BPipe's eviction lowers rank 0's real peak and moves the bytes
to its partner, gradients stay exact, and no sent buffer outlives its send."""

from __future__ import annotations

import pytest

from tests.memory_runs import (
    CASES,
    check_eviction,
    check_gradients,
    check_real_peaks,
    check_sends,
    run_memory_cases,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_memory_cases("tiny", 4, 8, tmp_path_factory.mktemp("memory"), timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_gradients_exact_and_real_peaks_as_predicted(runs, case):
    check_gradients(runs, case)
    check_real_peaks(runs, case)


@pytest.mark.parametrize("case", CASES)
def test_sent_buffers_go_when_their_send_completes(runs, case):
    check_sends(runs, case)


def test_eviction_lowers_rank_0_real_peak(runs):
    check_eviction(runs)
