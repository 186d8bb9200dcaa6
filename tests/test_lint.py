"""The tree is ruff-clean: a lint finding or an unformatted file fails the suite,
not a later review.

ruff is pinned in the `test` extra, so CI and every checkout lint with the same rules.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_ruff_finds_nothing_in_the_tree() -> None:
    run = _ruff("check", "--output-format", "concise")
    assert run.returncode == 0, f"ruff check:\n{run.stdout}{run.stderr}"


def test_every_file_is_ruff_formatted() -> None:
    run = _ruff("format", "--check")
    assert run.returncode == 0, (
        f"ruff format --check (fix: ruff format .):\n{run.stdout}{run.stderr}"
    )
