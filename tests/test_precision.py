"""bf16 on any captured graph (pipec/frontend/precision.py, runtime/precision.py), without a
launch: the stages a bf16 run builds, what crosses their cuts, frozen parameters, and the
refusal of a model that cannot compute in bf16, named by its op before any rank starts.
(Training at bf16 on eight Hugging Face families: tests/test_hf_matrix.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipec.build_dir import emit
from pipec.cli import main as pipec_main
from pipec.frontend import FrontendError, build_stages
from pipec.frontend.precision import BOUNDARY_DTYPES
from pipec.model import compile_model
from pipec.runtime.precision import to_bf16
from tests.helpers import forbid_torchrun

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "frontend_models" / "hf.py"
BROKEN = ROOT / "tests" / "frontend_models" / "broken.py"


def _plan(spec: str, p: int = 2) -> dict:
    return compile_model(spec, "1f1b", p, 2).plan["model"]


def test_a_graph_captured_at_bf16_runs_where_a_cast_fp32_graph_cannot():
    """HF Llama records its RMSNorm's cast back to the input dtype as `to(float32)` when
    captured in fp32; cast afterwards, the stages mix dtypes. Captured at bf16 they run, and
    hold the model's own fp32 values until the runtime casts them."""
    spec = f"{ROOT}/examples/hf_llama.py:tiny"
    plan = _plan(spec)
    tokens = torch.randint(128, (2, 32))
    cast_after = to_bf16_stages(build_stages(spec, plan, [0]))
    # the graph turns grad mode off around the rotary table and raises before turning it back
    with torch.enable_grad(), pytest.raises(RuntimeError, match="dtype"):
        cast_after[0](tokens)
    assert torch.is_grad_enabled()
    at_bf16 = build_stages(spec, plan, [0], dtype=torch.bfloat16)
    assert {p.dtype for p in at_bf16[0].parameters()} == {torch.float32}
    fp32 = build_stages(spec, plan, [0])
    for (name, got), (_, want) in zip(
        at_bf16[0].named_parameters(), fp32[0].named_parameters(), strict=True
    ):
        assert torch.equal(got, want), name
    hidden = to_bf16_stages(at_bf16)[0](tokens)[0]  # the residual stream
    assert hidden.dtype == torch.bfloat16


def to_bf16_stages(stages: list) -> list:
    to_bf16(stages)
    return stages


def test_what_crosses_a_cut_at_bf16_is_measured_not_assumed():
    """Mamba keeps its residual stream in fp32 at bf16: the message carries fp32, which the
    plan's fp32 dtypes cast to bf16 would get wrong (a gloo size mismatch)."""
    spec = f"{HF}:mamba"
    stages = build_stages(spec, _plan(spec), [0, 1], dtype=torch.bfloat16)
    crossing = [s.meta[BOUNDARY_DTYPES] for s in stages]
    assert crossing[0]["inputs"] == (torch.int64,)
    assert crossing[0]["outputs"] == crossing[1]["inputs"]
    assert torch.float32 in crossing[1]["inputs"]


def test_a_frozen_parameter_stays_frozen_and_unhooked_at_bf16():
    """Whisper's sinusoidal encoder positions are a parameter with requires_grad=False: no
    fp32 gradient is kept for it, and no hook (registering one raised before)."""
    spec = f"{HF}:whisper"
    (stage,) = build_stages(spec, _plan(spec), [0], dtype=torch.bfloat16)
    frozen = [n for n, p in stage.named_parameters() if not p.requires_grad]
    assert frozen and all("embed_positions" in n for n in frozen)
    to_bf16([stage])
    for name, p in stage.named_parameters():
        assert hasattr(p, "main_grad") == p.requires_grad, name


FFT = "fourier_fx"


def test_an_op_without_bf16_is_named_with_its_module():
    """Captured by torch.fx, nothing runs until the stage does: the op that fails at bf16 is
    named, with the module it belongs to, in one line."""
    spec = f"{BROKEN}:{FFT}"
    with pytest.raises(FrontendError) as refused:
        build_stages(spec, _plan(spec), [0, 1], dtype=torch.bfloat16)
    message = str(refused.value)
    assert message.startswith(f"{spec} cannot train at --precision bf16: stage 1: fft")
    assert "blocks.1 (FourierMixer)" in message and "BFloat16" in message
    assert message.endswith("; train it at fp32 (drop --precision)")
    assert "\n" not in message


@pytest.mark.parametrize("factory", ["fourier", FFT])
def test_pipec_run_and_compile_refuse_bf16_before_anything_starts(
    tmp_path, monkeypatch, capsys, factory
):
    """`pipec run --precision bf16` checks before starting torchrun (exit 2, one line, no
    rank started); `pipec compile --precision bf16` before writing the build. The exported
    capture fails at bf16 already, the fx one when the stage runs."""
    spec = f"{BROKEN}:{factory}"
    emit(compile_model(spec, "1f1b", 2, 2), tmp_path / "b")
    forbid_torchrun(monkeypatch)
    with pytest.raises(SystemExit) as run:
        pipec_main(["run", str(tmp_path / "b"), "--steps", "1", "--precision", "bf16"])
    err = capsys.readouterr().err
    assert run.value.code == 2 and err.count("\n") == 1, err
    assert "cannot train at --precision bf16" in err and "FourierMixer" in err
    argv = ["compile", spec, "-s", "1f1b", "-p", "2", "-m", "2", "--precision", "bf16"]
    with pytest.raises(SystemExit) as compiled:
        pipec_main([*argv, "--out", str(tmp_path / "c")])
    assert compiled.value.code == 2 and not (tmp_path / "c").exists()
    assert "cannot train at --precision bf16" in capsys.readouterr().err
