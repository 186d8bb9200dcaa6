"""Interop with torch.distributed.pipelining: export builds as its CSV, compile its orders.

An imported order goes through the same driver as a pipec family (lower, simulate, verify), so
torch's schedules get pipec's invariants, figures, timeline and runtime.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipec.build_dir import load
from pipec.compile import CompileResult, Options, compile_from_schedule
from pipec.ir import PipecError, Schedule
from pipec.passes.costs import CostModel
from pipec.passes.from_torch import schedule_from_torch
from pipec.passes.to_torch import torch_rows
from pipec.torch_csv import read_csv, write_csv


def export_torch_csv(directory: Path, comms: bool) -> str:
    """A build directory's programs as torch's CSV (compute_only, or compute_comms)."""
    build = load(directory)
    try:
        return write_csv(torch_rows(build.compiled, comms))
    except PipecError as e:
        raise PipecError(f"{directory}: cannot export to torch-csv: {e}") from None


def _compile_imported(
    sched: Schedule, source: str, costs: CostModel, memory_limit: float | None
) -> CompileResult:
    try:
        return compile_from_schedule(sched, Options(costs, memory_limit))
    except PipecError as e:
        raise PipecError(f"{source}: the imported order does not compile: {e}") from None


def compile_torch_csv(
    path: Path,
    costs: CostModel,
    memory_limit: float | None = None,
    expect: tuple[int | None, int | None, int | None] = (None, None, None),
) -> CompileResult:
    """Compile the order in a torch CSV; `expect` is the (p, m, v) the user gave, if any."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PipecError(f"--from-torch-csv {path}: cannot read it ({e})") from None
    name = "torch-csv:" + re.sub(r"[^\w.-]", "_", path.stem)
    sched = schedule_from_torch(name, read_csv(text, str(path)), str(path))
    for flag, given, found in zip(
        ("--pp", "--microbatches", "--chunks"), expect, (sched.p, sched.m, sched.v)
    ):
        if given is not None and given != found:
            raise PipecError(
                f"{flag} {given} does not match {path}, which has {found}; drop {flag}"
            )
    return _compile_imported(sched, str(path), costs, memory_limit)


def compile_torch_class(
    name: str, p: int, m: int, v: int | None, costs: CostModel, memory_limit: float | None = None
) -> tuple[CompileResult, list[str]]:
    """Compile torch's own order for schedule class `name`; also the notes on what was fixed."""
    from pipec.torch_orders import torch_order  # imports torch

    cls_name, rows, notes = torch_order(name, p, m, v)
    source = f"torch's {cls_name} order (p={p}, m={m})"
    sched = schedule_from_torch(f"torch:{cls_name}", rows, source)
    return _compile_imported(sched, source, costs, memory_limit), notes
