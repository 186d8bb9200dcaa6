"""Training features on models nobody here wrote: eight Hugging Face families
(tests/frontend_models/hf.py: RoPE/GQA decoders, ALiBi, partial rotary, an SSM, an
encoder-decoder with a convolutional front end and frozen positions, a vision model of nested
stacks), each compiled for 1F1B on 2 ranks, trained 3 steps at fp32 and at bf16 with a
checkpoint at steps 2 and 3, and resumed from step 2, all in ONE torchrun launch
(tests/train_worker.py).

- fp32 equals the plain one-process loop (tests/plain_loop.py);
- bf16 equals the plain loop under the same policy (the model cast to bf16, fp32 masters),
  and its step-3 loss is within 5% of fp32's;
- resumed from step 2, step 3 has the uninterrupted run's loss, and the plain model loaded
  from step 2's checkpoint (`load_full`) has it too;
- `export_model` of step 3 holds every tensor of the model's state_dict once under its own
  name, equal to what `load_full` loads (a Hugging Face class loads it with `from_pretrained`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipec import checkpoint
from pipec.frontend import load_factory
from pipec.model import compile_model
from tests.plain_loop import plain_loop
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "frontend_models" / "hf.py"
WORKER = ROOT / "tests" / "train_worker.py"
FAMILIES = ("qwen3", "llama_tied", "gptj", "mpt", "gpt2", "mamba", "whisper", "swin")
PRECISIONS = ("fp32", "bf16")
P, M, LR, STEPS = 2, 2, 1e-3, 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-matrix")
    cases = {}
    for family in FAMILIES:
        build = compile_model(f"{HF}:{family}", "1f1b", P, M)
        for precision in PRECISIONS:
            name = f"{family}-{precision}"
            common = {"steps": STEPS, "lr": LR, "every": 2, "options": {"precision": precision}}
            whole = {"save": str(tmp / name), "resume": None, "full_loss": None}
            cases[name] = build, common | whole
            resume = str(checkpoint.step_dir(tmp / name, 2))
            again = {"save": None, "resume": resume, "full_loss": resume}
            cases[f"{name}-resumed"] = build, common | again
    return launch(cases, P, tmp, timeout=600, script=WORKER).results[0], tmp


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_and_bf16_train_as_the_plain_loop(runs, family):
    results, _ = runs
    spec = f"{HF}:{family}"
    fp32, bf16 = results[f"{family}-fp32"]["losses"], results[f"{family}-bf16"]["losses"]
    torch.testing.assert_close(fp32, plain_loop(spec, STEPS, M, LR)["losses"], rtol=1e-5, atol=0)
    want = plain_loop(spec, STEPS, M, LR, bf16=True)["losses"]
    torch.testing.assert_close(bf16, want, rtol=1e-2, atol=0)
    assert bf16 != fp32  # it did compute in bf16
    assert abs(bf16[-1] - fp32[-1]) <= 0.05 * fp32[-1]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_run_continues_the_uninterrupted_one(runs, family, precision):
    results, _ = runs
    whole, resumed = results[f"{family}-{precision}"], results[f"{family}-{precision}-resumed"]
    assert resumed["start"] == 2
    torch.testing.assert_close(resumed["losses"], whole["losses"][2:], rtol=1e-5, atol=0)
    # the plain model from the checkpoint, in fp32: bf16's step computed in bf16
    rtol = 1e-5 if precision == "fp32" else 2e-2
    torch.testing.assert_close(resumed["full_loss"], resumed["losses"][0], rtol=rtol, atol=0)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_export_model_holds_the_model_state(runs, family, precision, tmp_path):
    _, tmp = runs
    ck = checkpoint.step_dir(tmp / f"{family}-{precision}", STEPS)
    model = load_factory(f"{HF}:{family}").model
    assert checkpoint.load_full(ck, model) == STEPS
    exported = load_file(checkpoint.export_model(ck, tmp_path))
    state = model.state_dict()
    assert exported.keys() == state.keys()
    for key, value in state.items():
        assert (
            exported[key].dtype == torch.float32
        )  # the fp32 masters, whatever the run's precision
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0)
    if hasattr(model, "config"):  # a Hugging Face class: from_pretrained reads the export
        model.config.save_pretrained(tmp_path)
        loaded = type(model).from_pretrained(tmp_path)
        for key, value in state.items():
            torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
