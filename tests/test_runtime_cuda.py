"""The runtime on CUDA: one step's gradients equal the single-process reference on the same GPU
for 1F1B, ZB-V, V-Half, BitPipe and 1F1B --evict,

- with 4 ranks sharing one GPU (`launch.py --share-gpu`'s transport: gloo, every message staged
  through page-locked host memory), all cases in one torchrun launch of tests/runtime_harness.py;
- on a machine with two GPUs or more, on NCCL, one rank per GPU (p = 4, or 2 with fewer than
  four GPUs, where --evict has nothing to evict), through `launch.py --check-grads`.

The builds are compiled with the stash bytes measured on the GPU (`device="cuda"`: the saved
tensors of the kernels that run there). Marked `gpu`: `make gpu-check` runs them; skipped
without CUDA (the NCCL ones without two GPUs).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from pipec.build_dir import emit
from pipec.model import compile_model
from pipec.runtime.torchrun import torchrun
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
P, M = 4, 8
SCHEDULES = ["1f1b", "zb-v", "v-half", "bitpipe", "1f1b --evict"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def compiled_on_gpu(schedule: str, p: int):  # type: ignore[no-untyped-def]
    name, *flags = schedule.split()
    return compile_model(GPT, name, p, M, evict="--evict" in flags, device="cuda")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    cases = {s: (compiled_on_gpu(s, P), {"kind": "grads", "device": "cuda"}) for s in SCHEDULES}
    return launch(cases, P, tmp_path_factory.mktemp("cuda"), timeout=540).results


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_of_ranks_sharing_a_gpu_equal_the_reference(launched, schedule):
    for rank, res in enumerate(launched):
        assert res[schedule]["ok"], f"rank {rank}: {res[schedule]}"
        assert res[schedule]["staged_out"] and res[schedule]["staged_in"]  # crossed host memory


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_on_nccl_with_a_gpu_per_rank_the_gradients_equal_the_reference(tmp_path, schedule):
    p = 4 if torch.cuda.device_count() >= 4 else 2
    emit(compiled_on_gpu(schedule, p), tmp_path / "build")
    cmd, env = torchrun(tmp_path / "build/launch.py", p, "--check-grads")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check-grads: ok, every stage matches" in proc.stdout
