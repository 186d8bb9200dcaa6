"""Run compiled cases in ONE torchrun launch of tests/runtime_harness.py (see its docstring).

A launch costs seconds (processes start, import torch, meet), so a test file compiles all its
cases first and runs them together; this is the launcher the runtime test files share. `refused`
runs one rank of launch.py in-process instead, for the refusals that come before any
communication.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from pipec.build_dir import emit
from pipec.compile import CompileResult
from pipec.runtime.interpreter import HANDLERS
from pipec.runtime.main import main
from pipec.runtime.torchrun import torchrun

HARNESS = Path(__file__).resolve().parent / "runtime_harness.py"


@dataclass(frozen=True)
class Launched:
    """Per rank, the harness's results by case name; the launch's stdout; each case's build."""

    results: list[dict]
    stdout: str
    builds: dict[str, Path]


def launch(
    cases: dict[str, tuple[CompileResult, dict]],
    world: int,
    tmp: Path,
    timeout: float,
    script: Path = HARNESS,
) -> Launched:
    """Emit every case under `tmp`, run them all on `world` ranks with `script` (the harness,
    or a worker taking the same two arguments); fail with the ranks' errors."""
    listing = []
    for k, (name, (result, extra)) in enumerate(cases.items()):
        emit(result, tmp / f"case{k}")
        listing.append({"name": name, "build": str(tmp / f"case{k}")} | extra)
    return run_cases(listing, world, tmp, timeout, script)


def run_cases(
    listing: list[dict], world: int, tmp: Path, timeout: float, script: Path = HARNESS
) -> Launched:
    """Run cases whose builds are written (`{"name", "build", "kind", ...}`, see the harness)
    with `script`."""
    (tmp / "cases.json").write_text(json.dumps(listing))
    (tmp / "results").mkdir()
    cmd, env = torchrun(script, world, str(tmp / "cases.json"), str(tmp / "results"))
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, _errors(proc.stderr)
    results = [json.loads((tmp / "results" / f"{r}.json").read_text()) for r in range(world)]
    return Launched(results, proc.stdout, {c["name"]: Path(c["build"]) for c in listing})


def _errors(stderr: str) -> str:
    """The first failing rank's traceback, then the end of stderr: it is often far above the
    last rank's."""
    lines = stderr.splitlines()
    raised = [line for line in lines if re.match(r"\[rank\d+\]: \w+(Error|Exception)", line)]
    if not raised:
        return stderr[-3000:]
    rank = raised[0].split("]")[0] + "]"
    first = [line for line in lines if line.startswith(rank)]
    return "\n".join(first[-30:] + ["..."]) + stderr[-1500:]


def refused(
    build: Path, monkeypatch, capsys, *args: str, world: int = 4, rank: int = 0, handlers=HANDLERS
) -> str:
    """Run one rank's entry point in-process with no peers: it must exit 2 before joining any
    process group. Returns what it printed on stderr."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there: connecting would fail
    with pytest.raises(SystemExit) as e:
        main(build, ["--timeout", "5", *args], handlers)
    assert e.value.code == 2 and not dist.is_initialized()
    return capsys.readouterr().err


def said_by_rank_0(build: Path, monkeypatch, capsys, *args: str, **kw) -> str:
    """A defect every rank finds alike: rank 1 exits 2 in silence, rank 0 says it in one line."""
    assert refused(build, monkeypatch, capsys, *args, rank=1, **kw) == ""
    err = refused(build, monkeypatch, capsys, *args, rank=0, **kw)
    assert err.count("\n") == 1 and err.startswith("pipec runtime: ")
    assert not err.startswith("pipec runtime: rank 0: ")  # about every rank, not rank 0
    return err
