"""The tree is ruff-clean (STYLE.md 9): a lint finding fails the suite, not a later review.

ruff is pinned in the `test` extra, so CI and every checkout lint with the same rules.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing_in_the_tree() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, f"ruff check:\n{run.stdout}{run.stderr}"
