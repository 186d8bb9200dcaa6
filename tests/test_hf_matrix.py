"""Training features on models nobody here wrote: eight Hugging Face families
(tests/frontend_models/hf.py: RoPE/GQA decoders, ALiBi, partial rotary, an SSM, an
encoder-decoder with a convolutional front end and frozen positions, a vision model of nested
stacks), each compiled for 1F1B on 2 ranks and trained 3 steps at fp32 and at bf16 in ONE
torchrun launch (tests/train_worker.py).

- fp32 equals the plain one-process loop (tests/plain_loop.py);
- bf16 equals the plain loop under the same policy (the model cast to bf16, fp32 masters),
  and its step-3 loss is within 5% of fp32's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipec.model import compile_model
from tests.plain_loop import plain_loop
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "frontend_models" / "hf.py"
WORKER = ROOT / "tests" / "train_worker.py"
FAMILIES = ("qwen3", "llama_tied", "gptj", "mpt", "gpt2", "mamba", "whisper", "swin")
P, M, LR, STEPS = 2, 2, 1e-3, 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-matrix")
    cases = {}
    for family in FAMILIES:
        build = compile_model(f"{HF}:{family}", "1f1b", P, M)
        for precision in ("fp32", "bf16"):
            case = {"steps": STEPS, "lr": LR, "save": None, "every": 0, "resume": None}
            case |= {"full_loss": None, "options": {"precision": precision}}
            cases[f"{family}/{precision}"] = (build, case)
    return launch(cases, P, tmp, timeout=600, script=WORKER).results[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_and_bf16_train_as_the_plain_loop(runs, family):
    spec = f"{HF}:{family}"
    fp32, bf16 = runs[f"{family}/fp32"]["losses"], runs[f"{family}/bf16"]["losses"]
    torch.testing.assert_close(fp32, plain_loop(spec, STEPS, M, LR)["losses"], rtol=1e-5, atol=0)
    want = plain_loop(spec, STEPS, M, LR, bf16=True)["losses"]
    torch.testing.assert_close(bf16, want, rtol=1e-2, atol=0)
    assert bf16 != fp32  # it did compute in bf16
    assert abs(bf16[-1] - fp32[-1]) <= 0.05 * fp32[-1]
