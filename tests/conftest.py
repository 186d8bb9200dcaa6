"""Shared test set-up: `pytest --update-golden` rewrites tests/golden/; Triton interprets on CPU."""

import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter. The flag must be set before any
# test module imports runtime.kernels (where the kernels are decorated), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

GOLDEN = Path(__file__).parent / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite golden files instead of comparing"
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """Compare text with tests/golden/NAME, or rewrite it under --update-golden."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = GOLDEN / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        assert path.exists(), f"missing golden file {path}; run pytest --update-golden"
        assert text == path.read_text(), f"{path} differs; if intended, run pytest --update-golden"

    return check
