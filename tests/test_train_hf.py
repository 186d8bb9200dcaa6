"""Checkpoints of Hugging Face models, in ONE torchrun launch of tests/train_worker.py (4 ranks,
p=2 x 2 data-parallel copies): examples/hf_llama.py's tiny Llama under ZeRO-1, a Llama whose
LM head is tied to its embedding (tests/train_factories.py), and BERT's masked LM with dropout
on (tests/frontend_models/hf.py). Each Llama stage holds the rotary tables as a buffer the
model's state_dict leaves out; the tied parameter sits on the first and last stage; BERT's
head bias is also its decoder's, a name its graph never reads. Saved at step 2 and resumed,
step 3 has the uninterrupted run's loss (BERT's dropout draws the same masks); every tensor is
written once, and `load_full` and `export_model` read the checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipec import checkpoint
from pipec.frontend import load_factory
from pipec.model import compile_model
from tests.runtime_launch import launch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "train_worker.py"
SPECS = {
    "llama": f"{ROOT}/examples/hf_llama.py:tiny",
    "tied": f"{ROOT}/tests/train_factories.py:tied_llama",
    "bert": f"{ROOT}/tests/frontend_models/hf.py:bert",
}
OPTIONS = {"llama": {"zero": True}, "tied": {}, "bert": {}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-hf")
    cases = {}
    for name, spec in SPECS.items():
        build = compile_model(spec, "1f1b", 2, 2, dp=2)
        common = {"steps": 3, "lr": 1e-2, "every": 2, "options": OPTIONS[name]}
        cases[name] = build, common | {"save": str(tmp / name), "resume": None, "full_loss": None}
        resume = str(checkpoint.step_dir(tmp / name, 2))
        # the plain model's loss on step 3's batch, but where dropout draws other masks
        full = resume if name != "bert" else None
        again = {"save": None, "resume": resume, "full_loss": full}
        cases[f"{name}-resumed"] = build, common | again
    return launch(cases, 4, tmp, timeout=420, script=WORKER).results, tmp


@pytest.mark.parametrize("name", list(SPECS))
def test_a_resumed_llama_continues_the_uninterrupted_run(runs, name):
    results, _ = runs
    resumed, whole = results[0][f"{name}-resumed"], results[0][name]
    assert resumed["start"] == 2
    torch.testing.assert_close(resumed["losses"], whole["losses"][2:], rtol=1e-5, atol=0)
    if name != "bert":
        torch.testing.assert_close(resumed["full_loss"], resumed["losses"][0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", list(SPECS))
def test_each_tensor_is_written_once_and_exported(runs, name, tmp_path):
    _, tmp = runs
    ck = checkpoint.step_dir(tmp / name, 3)
    saved = json.loads((ck / "manifest.json").read_text())
    model = load_factory(SPECS[name]).model
    assert saved["tensors"].keys() | saved["aliases"].keys() >= {
        f"model.{k}" for k in model.state_dict()
    }
    assert not any("rotary_emb" in key for key in saved["tensors"])  # not persistent
    if name == "tied":
        assert saved["aliases"]["model.lm_head.weight"] == "model.model.embed_tokens.weight"
    assert checkpoint.load_full(ck, model) == 3
    checkpoint.export_model(ck, tmp_path)
    model.config.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
