"""The runtime on CUDA, p ranks sharing one GPU (`launch.py --share-gpu`'s transport: gloo,
every message staged through page-locked host memory): one step's gradients equal the
single-process reference on the same GPU for 1F1B, ZB-V, V-Half, BitPipe and 1F1B --evict.

The builds are compiled with the stash bytes measured on the GPU (`device="cuda"`: the saved
tensors of the kernels that run there), all cases in one torchrun launch of
tests/runtime_harness.py. Marked `gpu`: `make gpu-check` runs it; skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipec.model import compile_model
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
P, M = 4, 8
SCHEDULES = ["1f1b", "zb-v", "v-half", "bitpipe", "1f1b --evict"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    cases = {}
    for schedule in SCHEDULES:
        name, *flags = schedule.split()
        result = compile_model(GPT, name, P, M, evict="--evict" in flags, device="cuda")
        cases[schedule] = (result, {"kind": "grads", "device": "cuda"})
    return launch(cases, P, tmp_path_factory.mktemp("cuda"), timeout=540).results


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_of_ranks_sharing_a_gpu_equal_the_reference(launched, schedule):
    for rank, res in enumerate(launched):
        assert res[schedule]["ok"], f"rank {rank}: {res[schedule]}"
        assert res[schedule]["staged_out"] and res[schedule]["staged_in"]  # crossed host memory
