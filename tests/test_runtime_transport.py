"""The communication layer's NCCL and shared-GPU paths, run for real on CPU ranks over gloo.

NCCL's protocol forced on gloo: every message through `batch_isend_irecv`, one batch per entry
of `passes.batches.message_batches`, all tags 0, so gloo matches messages in issue order per
pair and direction as NCCL does (a message matched with the wrong receive would give wrong
gradients or a size error). The shared-GPU mode's staging forced on CPU tensors (not pinned):
every message crosses a host copy. For 1F1B, ZB-V, V-Half, BitPipe and 1F1B --evict the
gradients equal the single-process reference; the batches issued are the pass's, and every
send and receive was staged. One torchrun launch of tests/runtime_harness.py, 4 ranks. And
where `launch.py --share-gpu` puts each rank, and what it refuses before any communication.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipec.build_dir import emit
from pipec.ir import RECV_OPS, SEND_OPS, Op
from pipec.model import compile_model
from pipec.passes.batches import message_batches
from pipec.runtime.preflight import rank_device
from tests.runtime_launch import launch, said_by_rank_0

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
DATA = f"{ROOT}/tests/train_factories.py:copying"
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


def test_where_each_rank_computes(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device
    assert rank_device("gloo", False, 3) == cpu
    assert rank_device("nccl", False, 2) == cuda("cuda", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    shared = [rank_device("gloo", True, r) for r in range(4)]
    assert shared == [cuda("cuda", 0), cuda("cuda", 1), cuda("cuda", 0), cuda("cuda", 1)]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("share") / "build"
    emit(compile_model(DATA, "1f1b", 2, 4), out)
    return out


def test_share_gpu_refuses_nccl(build, monkeypatch, capsys):
    err = said_by_rank_0(build, monkeypatch, capsys, "--share-gpu", "--backend", "nccl", world=2)
    assert err == (
        "pipec runtime: --share-gpu runs on gloo: NCCL refuses two ranks on one GPU; "
        "drop --backend nccl\n"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_share_gpu_without_cuda(build, monkeypatch, capsys):
    err = said_by_rank_0(build, monkeypatch, capsys, "--share-gpu", world=2)
    assert err == (
        "pipec runtime: --share-gpu needs CUDA, and torch sees no GPU here; drop it to run on CPU\n"
    )
