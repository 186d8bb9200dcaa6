"""Run compiled cases in ONE torchrun launch of tests/runtime_harness.py (see its docstring).

A launch costs seconds here (FACTS.md), so a test file compiles all its cases first and runs
them together; this is the launcher the runtime test files share.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipec.build_dir import emit
from pipec.compile import CompileResult
from runtime.torchrun import torchrun

HARNESS = Path(__file__).resolve().parent / "runtime_harness.py"


@dataclass(frozen=True)
class Launched:
    """Per rank, the harness's results by case name; the launch's stdout; each case's build."""

    results: list[dict]
    stdout: str
    builds: dict[str, Path]


def launch(
    cases: dict[str, tuple[CompileResult, dict]], world: int, tmp: Path, timeout: float
) -> Launched:
    """Emit every case under `tmp`, run them all on `world` ranks; fail with the ranks' errors."""
    listing = []
    for k, (name, (result, extra)) in enumerate(cases.items()):
        emit(result, tmp / f"case{k}")
        listing.append({"name": name, "build": str(tmp / f"case{k}")} | extra)
    return run_cases(listing, world, tmp, timeout)


def run_cases(listing: list[dict], world: int, tmp: Path, timeout: float) -> Launched:
    """Run cases whose builds are written (`{"name", "build", "kind", ...}`, see the harness)."""
    (tmp / "cases.json").write_text(json.dumps(listing))
    (tmp / "results").mkdir()
    cmd, env = torchrun(HARNESS, world, str(tmp / "cases.json"), str(tmp / "results"))
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp / "results" / f"{r}.json").read_text()) for r in range(world)]
    return Launched(results, proc.stdout, {c["name"]: Path(c["build"]) for c in listing})
