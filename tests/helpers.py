"""Small helpers shared by the tests."""

import importlib
import multiprocessing as mp
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from pipec import progress
from pipec.compile import CompileResult, compile_schedule
from pipec.passes.costs import CostModel, parse_costs
from pipec.runtime.rank import Rank
from pipec.runtime.step_state import StashBytes

CHUNK_UNITS = "per=chunk"
"""The papers' unit where they count chunk passes: each op of one chunk takes the cost as
given (F=B=W=1 by default), not its part of a rank's share. Figures drawn in chunk units
(ZB-V, V-shape, BitPipe, DualPipeV, torch's two-chunk orders) are reproduced with it."""


def run(
    schedule: str, p: int, m: int, v: int | None = None, costs: str = "", **kw
) -> CompileResult:
    """Compile (build, lower, simulate, verify) with costs given as the CLI's string."""
    return compile_schedule(schedule, p, m, v, parse_costs(costs) if costs else CostModel(), **kw)


def peaks(result: CompileResult) -> list[float]:
    return [r.peak_activations for r in result.sim.ranks]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` (relative path -> size, modification time): compared before
    and after, it shows whether anything there was written, replaced or removed."""
    if not root.is_dir():
        return {}
    return {
        str(f.relative_to(root)): (f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def ticking(monkeypatch, target: str, then=None) -> None:
    """Make `target` (module.function) deliver one timer tick while it runs, as a long run of
    it would, then return what it returns (or `then()`'s): deterministic whatever this
    machine's speed; the real timer never fires."""
    module, name = target.rsplit(".", 1)
    real = then or getattr(importlib.import_module(module), name)

    def tick(*args, **kw):
        signal.raise_signal(signal.SIGALRM)
        return real(*args, **kw)

    monkeypatch.setattr(target, tick)
    monkeypatch.setattr(progress, "FIRST_S", 3600.0)


def checkout_files(root: Path) -> list[Path]:
    """What git would commit under `root`: tracked files and new ones it does not ignore
    (deleted ones left out); links are listed as links."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [root / f for f in listed if (root / f).exists() or (root / f).is_symlink()]


def forbid_torchrun(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Make starting torchrun (runtime/torchrun.py) fail the test: for refusals that must come
    before any rank starts."""

    def started(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError(f"torchrun was started: {args[0] if args else kwargs}")

    monkeypatch.setattr("pipec.runtime.torchrun.subprocess.Popen", started)


def forked(target: Callable[..., None], ranks: int, *args: object) -> None:
    """`target(rank, *args)` in `ranks` forked processes, waited for (a minute each). Forked:
    the test process has no process group, so they inherit none."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)


def stand_in_rank(program, comm, meter, device: str = "cpu", params=(), optimizer=None):  # type: ignore[no-untyped-def]
    """What `run_program` reads of a Rank, for tests that drive the interpreter without a run:
    one place to follow the Rank's fields (the stash counter, the positions) as they change."""
    rt = SimpleNamespace(
        program=program,
        comm=comm,
        stash_bytes=StashBytes(),
        device=torch.device(device),
        meter=meter,
        positions=None,
        parameters=lambda: list(params),
        optimizer=optimizer,
    )
    rt.positions_for = lambda make: Rank.positions_for(rt, make)
    return rt


#: The watchdog `run_program` is handed when nothing watches the step.
NO_WATCHDOG = SimpleNamespace(current=None, leave=lambda: None)
