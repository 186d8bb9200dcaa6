"""The communication layer's NCCL and shared-GPU paths, run for real on CPU ranks over gloo.

NCCL's protocol forced on gloo: every message through `batch_isend_irecv`, one batch per entry
of `passes.batches.message_batches`, all tags 0, so gloo matches messages in issue order per
pair and direction as NCCL does (a message matched with the wrong receive would give wrong
gradients or a size error). The shared-GPU mode's staging forced on CPU tensors (not pinned):
every message crosses a host copy. For 1F1B, ZB-V, V-Half, BitPipe and 1F1B --evict the
gradients equal the single-process reference; the batches issued are the pass's, and every
send and receive was staged. One torchrun launch of tests/runtime_harness.py, 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from passes.batches import message_batches
from pipec.ir import RECV_OPS, SEND_OPS, Op
from pipec.model import compile_model
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
P, M = 4, 8
SCHEDULES = ["1f1b", "zb-v", "v-half", "bitpipe", "1f1b --evict"]
COMMS = ["nccl", "staged"]

pytestmark = pytest.mark.slow


def compiled(schedule: str):  # type: ignore[no-untyped-def]
    name, *flags = schedule.split()
    return compile_model(GPT, name, P, M, evict="--evict" in flags)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    results = {s: compiled(s) for s in SCHEDULES}
    cases = {
        f"{comm}/{s}": (results[s], {"kind": "grads", "comm": comm})
        for comm in COMMS
        for s in SCHEDULES
    }
    run = launch(cases, P, tmp_path_factory.mktemp("transport"), timeout=420)
    return results, run.results


@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_equal_the_reference(launched, comm, schedule):
    _, results = launched
    for rank, res in enumerate(results):
        assert res[f"{comm}/{schedule}"]["ok"], f"rank {rank}: {res[f'{comm}/{schedule}']}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_runtime_issues_the_passes_batches(launched, schedule):
    """Messages per batch_isend_irecv, in order, as message_batches says (one step)."""
    compiled_results, results = launched
    programs = compiled_results[schedule].compiled.programs
    for rank, res in enumerate(results):
        expected = [len(b) for b in message_batches(programs[rank])]
        assert res[f"nccl/{schedule}"]["batches"] == expected
    assert any(n > 1 for res in results for n in res[f"nccl/{schedule}"]["batches"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_message_is_staged(launched, schedule):
    """Each send copied out to host memory, each receive copied in from it; nothing batched."""
    compiled_results, results = launched
    programs = compiled_results[schedule].compiled.programs
    sends = SEND_OPS | {Op.EVICT, Op.RETURN}
    receives = RECV_OPS | {Op.ACCEPT, Op.LOAD}
    for rank, res in enumerate(results):
        seen = res[f"staged/{schedule}"]
        assert len(seen["staged_out"]) == sum(i.op in sends for i in programs[rank])
        assert len(seen["staged_in"]) == sum(i.op in receives for i in programs[rank])
        assert seen["batches"] == []
    assert any(res[f"staged/{schedule}"]["staged_out"] for res in results)
