"""Capture: torch.export first, torch.fx when export fails; the examples' attention is one node
either way; models neither can capture get one-line errors, a custom autograd.Function too."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipec.frontend import FrontendError, ModelSpec, build_model_plan, load_factory, split_model
from pipec.frontend.trace import export, trace
from pipec.runtime.kernels import attention

ROOT = Path(__file__).resolve().parents[1]
BROKEN = Path(__file__).resolve().parent / "frontend_models" / "broken.py"
FAILING_LINES = [
    i for i, line in enumerate(BROKEN.read_text().splitlines(), 1) if line.endswith("# FAILS")
]


@pytest.mark.parametrize("example", ["gpt", "llama"])
def test_examples_trace_with_attention_as_one_call(example):
    spec = load_factory(f"{ROOT}/examples/{example}.py:tiny")
    gm = trace(spec)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is attention]
    assert len(calls) == 8  # one per block
    assert torch.equal(gm(*spec.example_inputs), spec.model(*spec.example_inputs))


@pytest.mark.parametrize(
    "factory, line, expected",
    [
        (
            "data_dependent_if",
            FAILING_LINES[0],
            (
                "control flow depends on a traced value; "
                "move the branch out, use torch.cond, or pass a concrete argument"
            ),
        ),
        (
            "assert_on_shape",
            FAILING_LINES[1],
            "a Python assert on a traced value; remove the assert or pass a concrete argument",
        ),
        (
            "mask_buffer_slice",
            FAILING_LINES[2],
            "a tensor is sliced by a traced size; slice with a constant, mark the module a leaf",
        ),
    ],
)
def test_untraceable_models_name_module_location_and_fix(factory, line, expected):
    spec = load_factory(f"{BROKEN}:{factory}")
    with pytest.raises(FrontendError) as e:
        trace(spec)
    message = str(e.value)
    assert "\n" not in message
    assert "module 'blocks.1'" in message
    assert f"{BROKEN}:{line}:" in message
    assert expected in message


def test_leaf_module_fixes_the_buffer_slice():
    from frontend_models.broken import Decoder, MaskBufferSlice  # tests/ is on sys.path

    x = torch.randn(2, 8, 8)
    spec = ModelSpec(
        Decoder(MaskBufferSlice),
        (x,),
        x,
        torch.nn.functional.mse_loss,
        leaf_modules=(MaskBufferSlice,),
    )
    assert torch.equal(trace(spec)(x), spec.model(x))


def test_concrete_args_fix_a_flag_branch():
    class Flagged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        def forward(self, x, double=False):
            if double:
                x = 2 * x
            return self.blocks[0](x)

    x = torch.randn(3, 4)
    with pytest.raises(FrontendError, match="control flow"):
        trace(ModelSpec(Flagged(), (x,), x, torch.nn.functional.mse_loss, concrete_args=None))
    spec = ModelSpec(
        Flagged(), (x,), x, torch.nn.functional.mse_loss, concrete_args={"double": True}
    )
    gm = trace(spec)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert torch.equal(gm(x), spec.model(x, double=True))


@pytest.mark.parametrize("example", ["gpt.py:tiny", "gpt.py:tiny_tied", "llama.py:tiny"])
def test_examples_are_exported_with_attention_as_one_op(example):
    """The default capture is torch.export; the attention op stays one node per block, and
    the stages keep the model's parameter names."""
    spec = f"{ROOT}/examples/{example}"
    assert build_model_plan(spec, 2, "uniform", progress=False).capture == "export"
    stages = split_model(spec, 2, "uniform")
    ops = [n.target for st in stages for n in st.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.pipec.attention.default) == 8
    assert not [op for op in ops if "scaled_dot_product" in str(op)]
    names = {n for st in stages for n, _ in st.named_parameters(remove_duplicate=False)}
    model = load_factory(spec).model
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("factory", ["assert_on_shape", "mask_buffer_slice"])
def test_what_fx_cannot_trace_goes_through_export(factory):
    spec = load_factory(f"{BROKEN}:{factory}")
    stages = split_model(spec, 2, "uniform")  # capture "auto": export, which takes it
    x = spec.example_inputs
    torch.testing.assert_close(stages[1](stages[0](*x)), spec.model(*x), rtol=0, atol=0)


@pytest.mark.parametrize("capture", ["auto", "export"])
def test_a_data_dependent_branch_is_refused_in_one_line_by_export_too(capture):
    """Neither capture takes it; "auto" reports export's error (fx's is tested above)."""
    spec = replace(load_factory(f"{BROKEN}:data_dependent_if"), capture=capture)
    with pytest.raises(FrontendError) as e:
        split_model(spec, 2, "uniform")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("cannot export module 'blocks.1' (DataDependentIf)")
    assert f"{BROKEN}:{FAILING_LINES[0]}: `if x.sum() > 0:" in message
    assert "control flow depends on a traced value; move the branch out" in message


def test_export_returns_the_models_output_structure():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    spec = load_factory(f"{ROOT}/examples/hf_llama.py:tiny")
    gm = export(spec)
    out = gm(*spec.example_inputs)
    assert isinstance(out, CausalLMOutputWithPast)
    torch.testing.assert_close(out.logits, spec.model(*spec.example_inputs).logits)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)  # guards dropped


@pytest.mark.parametrize("capture", ["auto", "export", "fx"])
def test_a_custom_autograd_function_is_refused_in_one_line(capture):
    """A captured graph keeps a Function's forward and loses its backward: refused, naming
    the module, the line that applies it and the fixes."""
    spec = replace(load_factory(f"{BROKEN}:custom_function"), capture=capture)
    with pytest.raises(FrontendError) as e:
        split_model(spec, 2, "uniform")
    message = str(e.value)
    how = "trace" if capture == "fx" else "export"
    assert "\n" not in message
    assert message.startswith(f"cannot {how} module 'blocks.1' (CustomFunction)")
    assert f"{BROKEN}:{FAILING_LINES[3]}: `return ScaleGrad.apply(self.lin(x))" in message
    assert "applies the custom autograd.Function ScaleGrad, whose backward" in message
    assert "make it a torch.library.custom_op with register_autograd" in message


def test_a_wrapped_autograd_function_is_captured_by_fx_with_its_backward():
    """Export refuses it; torch.fx records the wrapped call, so the Function's own backward
    (a doubled gradient) runs in the stage."""
    spec = load_factory(f"{BROKEN}:wrapped_function")
    assert build_model_plan(spec, 2, "uniform", progress=False).capture == "fx"
    stages = split_model(spec, 2, "uniform")
    x = spec.example_inputs[0]
    stages[1](stages[0](x)).sum().backward()
    got = {n: p.grad.clone() for st in stages for n, p in st.named_parameters()}
    spec.model.zero_grad()
    spec.model(x).sum().backward()
    for name, p in spec.model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=0)
