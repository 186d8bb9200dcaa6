"""The factory contract: loading `file.py:factory` and `package.module:factory`, and its errors."""

from pathlib import Path

import pytest
import torch

from pipec.frontend import FrontendError, ModelSpec, load_factory

ROOT = Path(__file__).resolve().parents[1]
BROKEN = Path(__file__).resolve().parent / "frontend_models" / "broken.py"


def test_file_spec_relative_to_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = load_factory("examples/gpt.py:tiny")
    assert isinstance(spec, ModelSpec)
    out = spec.model(*spec.example_inputs)
    assert out.shape == (*spec.example_inputs[0].shape, 128)
    assert spec.loss_fn(out, spec.example_target).ndim == 0


def test_module_spec(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    spec = load_factory("examples.llama:tiny")
    assert type(spec.model).__name__ == "Llama"


def test_same_seed_same_weights_and_batch():
    a = load_factory(f"{ROOT}/examples/gpt.py:tiny")
    b = load_factory(f"{ROOT}/examples/gpt.py:tiny")
    c = load_factory(f"{ROOT}/examples/gpt.py:tiny", seed=1)
    for (name, p), q, r in zip(
        a.model.named_parameters(), b.model.parameters(), c.model.parameters()
    ):
        assert torch.equal(p, q), name
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("examples/gpt.py", "must look like path/to/file.py:factory"),
        ("no/such/file.py:tiny", "no file no/such/file.py"),
        ("no_such_package.models:tiny", "no module no_such_package.models"),
        (
            f"{ROOT}/examples/gpt.py:tinyy",
            "has no factory 'tinyy' (available: deep, gpt3_96b, small, tiny, tiny_tied)",
        ),
        (f"{BROKEN}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
        (f"{BROKEN}:not_a_spec", "returned dict; a factory must return pipec.frontend.ModelSpec"),
        (f"{BROKEN}:raises", "the factory raised RuntimeError: out of coffee"),
    ],
)
def test_errors_name_the_input_and_the_fix(spec, expected):
    with pytest.raises(FrontendError) as e:
        load_factory(spec)
    message = str(e.value)
    assert expected in message
    assert "\n" not in message
    assert isinstance(e.value, ValueError)


def test_model_spec_checks_its_fields():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(FrontendError, match=r"wrap a single tensor as \(x,\)"):
        ModelSpec(model, torch.zeros(2), torch.zeros(2), torch.nn.functional.mse_loss)
    with pytest.raises(FrontendError, match="must be an nn.Module"):
        ModelSpec("model", (torch.zeros(2),), torch.zeros(2), torch.nn.functional.mse_loss)
    x, loss = (torch.zeros(2),), torch.nn.functional.mse_loss
    with pytest.raises(FrontendError, match="capture='jit'; use one of auto, export, fx"):
        ModelSpec(model, x, x[0], loss, capture="jit")
    with pytest.raises(FrontendError, match="split_points must be a tuple of module names"):
        ModelSpec(model, x, x[0], loss, split_points="layers.4")  # type: ignore[arg-type]
