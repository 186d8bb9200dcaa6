"""Golden files: the emitted programs of every schedule family at p=4, m=8, and odd shapes.

Every registered family is covered automatically at p=4, m=8 with its default v; `EXTRA`
adds shapes that matter. `pytest --update-golden` rewrites them; review the diff.
"""

import pytest

from pipec.build_dir import render_files
from pipec.passes.registry import SCHEDULES, family
from tests.helpers import run

family("1f1b")  # registers the built-in families

EXTRA = [
    ("1f1b", 3, 5, None),
    ("1f1b", 4, 2, None),
    ("gpipe", 3, 5, None),
    ("gpipe", 4, 3, None),
    ("1f1b-r", 3, 5, None),
    ("interleaved", 3, 6, 3),
    ("interleaved", 4, 4, 2),
]
CASES = sorted({(name, 4, 8, None) for name in SCHEDULES} | set(EXTRA), key=str)


def golden_name(name: str, p: int, m: int, v: int) -> str:
    return f"{name}_p{p}_m{m}" + (f"_v{v}" if v != 1 else "") + ".pipe"


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_golden(name, p, m, v, golden):
    result = run(name, p, m, v)
    files = render_files(result)
    text = "".join(files[f"rank_{r:03d}.pipe"] for r in range(result.compiled.world))
    golden(golden_name(name, p, m, result.compiled.v), text)
