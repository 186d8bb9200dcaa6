"""The build directory: written atomically by `emit`, read back (and checked) by `load`.

OUT/rank_000.pipe ...   one program per rank (text form)
OUT/plan.json           schedule, layout, costs, model facts; its hash is in every program
OUT/stats.json          simulated makespan, bubbles, per-rank busy/span/peak
OUT/timeline.json       the simulated run as a Chrome/Perfetto trace
OUT/schedule.svg        a Gantt chart of the simulated run
OUT/launch.py           with a model: `torchrun --nproc-per-node P OUT/launch.py` trains
OUT/measured/           written by the runtime: measured timeline and peak stash bytes
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from codegen.render import dump_json, render_launch, render_program, render_svg, trace_json
from passes.costs import CostModel
from passes.residency import check_stash_bytes
from passes.simulate import SimResult, simulate
from passes.verify import verify
from pipec.beside import beside
from pipec.compile import PLAN_FORMAT, CompileResult, gc_paused, plan_hash
from pipec.ir import FORMAT_VERSION, Compiled, Layout, PipecError, instruction_count
from pipec.textform import Header, parse_program


def rank_file(rank: int) -> str:
    return f"rank_{rank:03d}.pipe"


def title(result: CompileResult) -> str:
    c = result.compiled
    return f"{c.schedule} p={c.p} m={c.m} v={c.v}"


def render_files(result: CompileResult) -> dict[str, str]:
    """Every file of the build directory, by name."""
    return render_half(result, 0) | render_half(result, 1)


def render_half(result: CompileResult, half: int) -> dict[str, str]:
    """Half of the files, by name (`emit` prints the two halves on two cores): 0, the Gantt
    chart and three ranks' programs in four; 1, the reports and the fourth rank's. Printing
    the timeline takes about as long as printing every program, the chart under half that,
    so the halves take about as long as each other."""
    c = result.compiled
    files = {}
    for rank in range(c.world):
        if (rank % 4 == 3) != (half == 1):
            continue
        header = Header(FORMAT_VERSION, rank, c.world, c.schedule, c.p, c.m, c.v, result.plan_hash)
        files[rank_file(rank)] = render_program(header, c.programs[rank])
    if half == 0:
        files["schedule.svg"] = render_svg(result.sim, title(result))
        return files
    stats = {"schedule": c.schedule, "p": c.p, "m": c.m, "v": c.v, "memory_unit": "stashes"}
    if result.costs.stash_bytes:
        stats["stash_bytes_per_chunk"] = list(result.costs.stash_bytes)
    stats |= result.sim.to_json()
    files["plan.json"] = result.plan_text
    files["stats.json"] = dump_json(stats)
    files["timeline.json"] = trace_json(result.sim.timeline, title(result))
    model = result.plan["model"]
    if model is not None:  # only a build with a model can train
        dp = result.plan.get("dp", 1)
        files["launch.py"] = render_launch(
            {
                "spec": model["spec"],
                "schedule": c.schedule,
                "p": c.p,
                "m": c.m,
                "v": c.v,
                "world": c.world,
                "dp": dp,
                "nproc": c.world * dp,
                "plan": result.plan_hash,
            }
        )
    return files


def check_out(out: Path, force: bool = False) -> None:
    """Refuse an `out` that `emit` could not write (before any work is done for it)."""
    if out.exists() and not out.is_dir():
        raise PipecError(f"--out {out} exists and is not a directory; choose another path")
    if out.exists() and any(out.iterdir()) and not force:
        raise PipecError(f"--out {out} exists and is not empty; pass --force to replace it")


def emit(result: CompileResult, out: Path, force: bool = False) -> None:
    """Write the build directory atomically: into a temporary sibling, then one rename.

    An existing non-empty `out` is replaced only with `force`; on any failure nothing is left.
    """
    out = Path(out)
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # On a large compile, half of the files print on the other core.
        work = instruction_count(result.compiled)
        with gc_paused(), beside(partial(_write, tmp, result, 0), work):
            _write(tmp, result, 1)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(directory: Path, result: CompileResult, half: int) -> None:
    for name, text in render_half(result, half).items():
        (directory / name).write_text(text)


@dataclass(frozen=True)
class Build:
    """A build directory read back: its plan, costs and parsed programs."""

    path: Path
    plan: dict
    plan_hash: str
    compiled: Compiled
    costs: CostModel


def load(path: Path) -> Build:
    """Read and check a build directory; PipecError names the file and the defect."""
    path = Path(path)
    plan_file = path / "plan.json"
    if not plan_file.is_file():
        raise PipecError(f"{path}: no plan.json here; is this a 'pipec compile --out' directory?")
    text = plan_file.read_text()
    try:
        plan = json.loads(text)
        if plan.get("format") != PLAN_FORMAT:
            raise PipecError(f"{plan_file}: format {plan.get('format')!r}, expected {PLAN_FORMAT}")
        layout = Layout.from_json(plan["layout"])
        costs = CostModel.from_json(plan["costs"])
        world, schedule = int(plan["world"]), plan["schedule"]
        p, m, v = int(plan["p"]), int(plan["m"]), int(plan["v"])
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, PipecError):
            raise
        raise PipecError(f"{plan_file}: corrupted plan ({type(e).__name__}: {e})") from None
    digest = plan_hash(text)
    programs = []
    for rank in range(world):
        f = path / rank_file(rank)
        if not f.is_file():
            raise PipecError(f"{f}: missing (the plan has {world} ranks)")
        header, program = parse_program(f.read_text(), str(f))
        expected = Header(FORMAT_VERSION, rank, world, schedule, p, m, v, digest)
        if header != expected:
            raise PipecError(
                f"{f}: header does not match plan.json (got '{header}', expected '{expected}'); "
                "recompile the directory"
            )
        programs.append(program)
    compiled = Compiled(schedule, p, m, v, layout, tuple(programs))
    return Build(path, plan, digest, compiled, costs)


def verify_build(build: Build) -> SimResult:
    """The checks of `pipec verify` on a loaded build (the invariants, and a byte limit when the
    plan has one); raises VerifyError naming rank, line and instruction. Returns the simulation
    the memory check ran on."""
    c = build.compiled
    verify(c, build.costs, None, build.plan.get("memory_limit"))
    sim = simulate(c.layout, c.programs, build.costs)
    if build.plan.get("memory_limit_bytes") is not None:
        check_stash_bytes(sim, build.plan["memory_limit_bytes"])
    return sim
