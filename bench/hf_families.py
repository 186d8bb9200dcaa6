"""Hugging Face families beyond the test matrix, through the CLI as a user runs them.

The suite trains eight families and BERT (tests/test_hf_matrix.py, tests/test_train_hf.py);
this checks the others a user may bring, each from a small config with random weights, in the
library's default configuration (dropout as configured: OPT, BERT and T5 train with it on).
For each family: `pipec compile FAMILY -s 1f1b -p 2 -m 2`, then at fp32 and at bf16
`pipec run --steps 3 --save CK --save-every 2`, `pipec run --steps 3 --resume CK/step_000002`,
and in this process `load_full` and `export_model` of step 3. A row says:

- loss: step 3's loss at fp32 and bf16 (bf16 within 5% of fp32);
- resumed: whether the run resumed from step 2 has step 3's loss of the uninterrupted run;
- export: whether `load_full` takes step 3 into the plain model and the export holds every
  entry of its state_dict;
- or the one line a refusal said (a family pipec cannot capture says why).

    PYTHONPATH=. python bench/hf_families.py [--families gemma3,opt,...]   # ~1 min a family
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers as hf
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipec import checkpoint
from pipec.frontend import ModelSpec, load_factory, next_token_loss
from pipec.ir import PipecError

VOCAB, SEQ, MB = 128, 16, 2
DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": SEQ,
}
GQA = DECODER | {"num_key_value_heads": 2}


def _lm(model: torch.nn.Module) -> ModelSpec:
    tokens, target = torch.randint(VOCAB, (MB, SEQ)), torch.randint(VOCAB, (MB, SEQ))
    return ModelSpec(model, (tokens,), target, lambda out, y: next_token_loss(out.logits, y))


def _classifier(model: torch.nn.Module) -> ModelSpec:
    images, labels = torch.randn(MB, 3, 32, 32), torch.randint(10, (MB,))
    return ModelSpec(
        model, (images,), labels, lambda out, y: torch.nn.functional.cross_entropy(out.logits, y)
    )


class _Seq2Seq(torch.nn.Module):
    """An encoder-decoder's logits from source and decoder ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, source: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=source, decoder_input_ids=ids).logits


def gemma3() -> ModelSpec:
    return _lm(hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(**GQA, head_dim=16, sliding_window=8)))


def gemma2() -> ModelSpec:
    return _lm(hf.Gemma2ForCausalLM(hf.Gemma2Config(**GQA, head_dim=16, sliding_window=8)))


def qwen3_moe() -> ModelSpec:
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    return _lm(hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(**GQA, head_dim=16, **moe)))


def stablelm() -> ModelSpec:
    return _lm(hf.StableLmForCausalLM(hf.StableLmConfig(**GQA)))


def starcoder2() -> ModelSpec:
    return _lm(hf.Starcoder2ForCausalLM(hf.Starcoder2Config(**GQA)))


def olmo2() -> ModelSpec:
    return _lm(hf.Olmo2ForCausalLM(hf.Olmo2Config(**GQA)))


def persimmon() -> ModelSpec:
    return _lm(hf.PersimmonForCausalLM(hf.PersimmonConfig(**DECODER)))


def granite() -> ModelSpec:
    return _lm(hf.GraniteForCausalLM(hf.GraniteConfig(**GQA)))


def mistral() -> ModelSpec:
    return _lm(hf.MistralForCausalLM(hf.MistralConfig(**GQA)))


def phi3() -> ModelSpec:
    return _lm(hf.Phi3ForCausalLM(hf.Phi3Config(**GQA, pad_token_id=0)))


def gpt_neox() -> ModelSpec:
    return _lm(hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**DECODER)))


def falcon() -> ModelSpec:
    config = hf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4
    )
    return _lm(hf.FalconForCausalLM(config))


def bloom() -> ModelSpec:
    config = hf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=4, n_head=4)
    return _lm(hf.BloomForCausalLM(config))


def opt() -> ModelSpec:
    config = hf.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=SEQ, word_embed_proj_dim=64,
    )  # fmt: skip
    return _lm(hf.OPTForCausalLM(config))


def codegen() -> ModelSpec:
    config = hf.CodeGenConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=SEQ, rotary_dim=8
    )
    return _lm(hf.CodeGenForCausalLM(config))


def bert() -> ModelSpec:
    return _lm(hf.BertForMaskedLM(hf.BertConfig(**DECODER)))


def convnext() -> ModelSpec:
    config = hf.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 6, 2], num_labels=10)
    return _classifier(hf.ConvNextForImageClassification(config))


def vit() -> ModelSpec:
    config = hf.ViTConfig(
        image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, num_labels=10,
    )  # fmt: skip
    return _classifier(hf.ViTForImageClassification(config))


def t5() -> ModelSpec:
    config = hf.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    source, ids = torch.randint(VOCAB, (MB, SEQ)), torch.randint(VOCAB, (MB, SEQ))
    model = _Seq2Seq(hf.T5ForConditionalGeneration(config))
    return ModelSpec(model, (source, ids), ids, next_token_loss)


FAMILIES = {
    f.__name__: f
    for f in (
        gemma3, gemma2, qwen3_moe, stablelm, starcoder2, olmo2, persimmon, granite, mistral,
        phi3, gpt_neox, falcon, bloom, opt, codegen, bert, convnext, vit, t5,
    )
}  # fmt: skip
LOSS = re.compile(r"^step\s+3/3\s+loss (\S+)", re.MULTILINE)


def pipec(*args: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pipec", *args], capture_output=True, text=True, check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def check(name: str, tmp: Path) -> str:
    """One family's row."""
    build = tmp / name
    code, said = pipec("compile", f"{__file__}:{name}", "-s", "1f1b", "-p", "2", "-m", "2",
                       "--out", str(build))  # fmt: skip
    if code:
        return f"refused: {last_line(said)[:150]}"
    cells = []
    losses = {}
    for precision in ("fp32", "bf16"):
        ck = tmp / f"{name}-{precision}"
        run = ("run", str(build), "--steps", "3", "--precision", precision)
        code, said = pipec(*run, "--save", str(ck), "--save-every", "2")
        if code or not LOSS.search(said):
            return f"{precision} run failed: {last_line(said)[:150]}"
        losses[precision] = float(LOSS.search(said).group(1))
        code, said = pipec(*run, "--resume", str(checkpoint.step_dir(ck, 2)))
        resumed = float(LOSS.search(said).group(1)) if not code and LOSS.search(said) else None
        try:
            model = load_factory(f"{__file__}:{name}").model
            checkpoint.load_full(checkpoint.step_dir(ck, 3), model)
            exported = checkpoint.export_model(checkpoint.step_dir(ck, 3), tmp / f"x-{name}")
            export = "ok" if load_file(exported).keys() == model.state_dict().keys() else "keys"
        except PipecError as e:
            export = f"refused ({str(e)[:80]})"
        same = resumed == losses[precision]
        cells.append(f"{precision} resumed {'equal' if same else resumed}, export {export}")
    near = abs(losses["bf16"] - losses["fp32"]) <= 0.05 * losses["fp32"]
    loss = f"loss {losses['fp32']:.4f} / {losses['bf16']:.4f}{'' if near else ' (bf16 off)'}"
    return "; ".join([loss, *cells])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names")
    names = ap.parse_args().families.split(",")
    if unknown := [n for n in names if n not in FAMILIES]:
        ap.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(names, 1):
            print(f"[{k}/{len(names)}] {name}: compile, 3 steps at fp32 and bf16, resume, export",
                  file=sys.stderr, flush=True)  # fmt: skip
            print(f"{name:11s} {check(name, Path(tmp))}", flush=True)


if __name__ == "__main__":
    main()
