"""Shared test set-up: `pytest --update-golden` rewrites tests/golden/; Triton interprets on CPU."""

import os
import signal
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter. The flag must be set before any
# test module imports runtime.kernels (where the kernels are decorated), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# A command's progress lines come every few seconds of wall time: how many a test sees would
# depend on the machine's load. Tests that count stderr's lines (one-line errors, the docs'
# transcripts) run without them; tests of progress turn them on (tests/test_footprint.py).
os.environ.setdefault("PIPEC_PROGRESS", "0")

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[1]
# The tests' factories and workers import `tests.…` and `examples.…` as packages, also in the
# ranks torchrun starts: the checkout goes on their PYTHONPATH, as a developer's shell would put
# it. pipec itself adds nothing (tests/test_wheel.py runs a build without it).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))


def _repository_outputs() -> tuple[list[str], dict]:
    """What a test could leave in the checkout: the root's entries (not hidden, no caches) and
    every file under build/, where `make demo` keeps its build and checkpoints."""
    from tests.helpers import tree

    names = sorted(
        p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name != "__pycache__"
    )
    return names, tree(ROOT / "build")


@pytest.fixture(scope="session", autouse=True)
def _tests_write_only_to_temporary_directories():
    """Tests write to tmp_path, never into the checkout: a file they leave in its root or a
    change under build/ (the default --out, where `make demo` keeps build/demo) fails the run."""
    before = _repository_outputs()
    yield
    after = _repository_outputs()
    added = sorted(set(after[0]) - set(before[0]))
    changed = sorted(
        k for k in before[1].keys() | after[1].keys() if before[1].get(k) != after[1].get(k)
    )
    assert not added and not changed, (
        f"tests wrote into the checkout {ROOT}: new {added}, build/ changed {changed[:10]}"
    )


@pytest.fixture(autouse=True)
def _signal_mask_is_left_as_found():
    """Every process a later test starts inherits the pytest process's blocked signals: a test
    that leaves SIGTERM blocked (importing a rank's script runs its `take_termination_signals`)
    makes every SIGTERM test after it fail far from the cause. It fails here instead."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert after == before, f"the test left signals blocked: {sorted(s.name for s in after)}"


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
