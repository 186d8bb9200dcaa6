"""The build directory: written atomically by `emit`, read back (and checked) by `load`.

OUT/rank_000.pipe ...   one program per rank (text form)
OUT/eval_rank_000.pipe  with a model: each rank's forward-only program, for evaluation
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
import re
import shutil
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from pipec.beside import beside
from pipec.codegen.render import (
    ChartFacts,
    dump_json,
    render_launch,
    render_program,
    render_svg,
    trace_json,
)
from pipec.compile import PLAN_FORMAT, CompileResult, check_dp, gc_paused, plan_hash
from pipec.ir import FORMAT_VERSION, Compiled, Layout, PipecError, Program, instruction_count
from pipec.passes.costs import CostModel
from pipec.passes.forward_only import verify_forward
from pipec.passes.residency import check_stash_bytes
from pipec.passes.simulate import SimResult, simulate
from pipec.passes.stash_timeline import stash_over_time
from pipec.passes.verify import verify
from pipec.textform import Header, parse_program

#: The files of every build besides its rank programs; a run adds the folder MEASURED.
REPORTS = ("plan.json", "stats.json", "timeline.json", "schedule.svg")
MEASURED = "measured"


#: How a build compiled without --profile words its costs: FLOP estimates at an assumed speed.
ESTIMATE_NOTE = (
    "costs are FLOP estimates at an assumed {tflops:g} TFLOP/s, not measured here "
    "(compile with --profile to time the stages on this machine)"
)


def rank_file(rank: int) -> str:
    return f"rank_{rank:03d}.pipe"


def eval_file(rank: int) -> str:
    """The rank's evaluation program (passes/forward_only.py), beside its training one."""
    return f"eval_{rank_file(rank)}"


def title(result: CompileResult) -> str:
    c = result.compiled
    return f"{c.schedule} p={c.p} m={c.m} v={c.v}"


def chart_facts(result: CompileResult) -> ChartFacts:
    """What the Gantt chart shows besides the timeline (see codegen/render.py's ChartFacts)."""
    c = result.compiled
    memory = stash_over_time(c.layout, c.programs, result.costs, result.sim)
    unit, note = time_unit(result.plan)
    limit = result.plan["memory_limit"]  # in stashes; None when given in bytes
    return ChartFacts(c.layout, memory, unit, note, limit)


def time_unit(plan: dict) -> tuple[str, str]:
    """The unit of a plan's times ('ms' for a model build; '' for schedule studies, whose
    costs are in the user's unit) and, for costs the frontend estimated from FLOPs rather
    than measured, a note that says so."""
    model = plan.get("model")
    if model is None:
        return "", ""
    cost = model.get("cost", {})
    if cost.get("source") != "estimate":
        return "ms", ""
    return "ms", ESTIMATE_NOTE.format(tflops=cost["flops_per_s"] / 1e12)


def render_files(result: CompileResult) -> dict[str, str]:
    """Every file of the build directory, by name."""
    return render_half(result, 0) | render_half(result, 1)


def render_half(result: CompileResult, half: int) -> dict[str, str]:
    """Half of the files, by name (`emit` prints the two halves on two cores): 0, the Gantt
    chart and the even ranks' programs; 1, the reports and the odd ranks'. The chart, the
    timeline and all the programs take about as long as each other to print (p=64,
    m=1024), so the halves do too."""
    c = result.compiled
    files = {}
    for rank in range(c.world):
        if rank % 2 != half:
            continue
        header = Header(FORMAT_VERSION, rank, c.world, c.schedule, c.p, c.m, c.v, result.plan_hash)
        files[rank_file(rank)] = render_program(header, c.programs[rank])
        if result.eval_programs:
            files[eval_file(rank)] = render_program(header, result.eval_programs[rank])
    if half == 0:
        files["schedule.svg"] = render_svg(result.sim, title(result), chart_facts(result))
        return files
    files["plan.json"] = result.plan_text
    files["stats.json"] = dump_json(stats(c, result.costs, result.sim))
    files["timeline.json"] = trace_json(result.sim.timeline, title(result))
    if result.plan["model"] is not None:  # only a build with a model can train
        files["launch.py"] = launch_text(result.plan, result.plan_hash)
    return files


def launch_text(plan: dict, digest: str) -> str:
    """OUT/launch.py of a build with a model: all of it follows from the plan, so a run and
    `verify` can tell an edited one."""
    dp, world = int(plan.get("dp", 1)), int(plan["world"])
    facts = {key: plan[key] for key in ("schedule", "p", "m", "v")}
    return render_launch(
        facts
        | {"spec": plan["model"]["spec"], "world": world, "dp": dp, "nproc": world * dp}
        | {"plan": digest}
    )


def stats(c: Compiled, costs: CostModel, sim: SimResult) -> dict:
    """OUT/stats.json's content: the shape and the simulated figures."""
    out = {"schedule": c.schedule, "p": c.p, "m": c.m, "v": c.v, "memory_unit": "stashes"}
    if costs.stash_bytes:
        out["stash_bytes_per_chunk"] = list(costs.stash_bytes)
    return out | sim.to_json()


def file_names(plan: dict) -> set[str]:
    """The files a build of `plan` holds (a run adds the folder MEASURED beside them)."""
    ranks = range(int(plan["world"]))
    names = {rank_file(rank) for rank in ranks} | set(REPORTS)
    if plan.get("model") is not None:
        names |= {"launch.py", *map(eval_file, ranks)}
    return names


def emit(result: CompileResult, out: Path, force: bool = False) -> None:
    """Write the build directory atomically: into a temporary sibling, then one rename.

    An existing non-empty `out` is replaced only with `force`, and only when it is a pipec
    build holding no other build; on any failure nothing is left. Temporaries that earlier
    compiles left beside it when they were killed are removed first (see `_remove_stale`).
    """
    out = Path(out)
    check_out(out, force, result.compiled.schedule)
    try:
        _emit(result, out)
    except OSError as e:
        raise PipecError(f"--out {out}: cannot write the build there ({e.strerror or e})") from None


def _emit(result: CompileResult, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out.parent)
    # Named after this process, so a later compile can tell when its owner is gone; created
    # with the umask's mode (mkdtemp's would be 0700, and the rename keeps it).
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    tmp.mkdir()
    try:
        # On a large compile, half of the files print on the other core.
        work = instruction_count(result.compiled)
        with gc_paused(), beside(partial(_write, tmp, result, 0), work):
            _write(tmp, result, 1)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_out(out: Path, force: bool = False, schedule: str | None = None) -> None:
    """Refuse an --out that emit cannot replace as a whole, or must not (before any work is
    done for it): the working directory or one holding it, a file, a non-empty directory
    without `force`, and, even with it, a directory that is not a pipec build or that holds
    another build (`make demo` writes build/demo: replacing build would delete it). The
    message suggests a directory beside the others, named after `schedule` when given."""
    try:
        inside = Path.cwd().resolve().is_relative_to(out.resolve())
    except OSError:  # the working directory is gone: nothing of it to protect
        inside = False
    if inside:
        raise PipecError(
            f"--out {out} is the working directory or holds it, and a build replaces its --out "
            f"as a whole; name a new subdirectory, e.g. --out {out / 'build'}"
        )
    if out.exists() and not out.is_dir():
        raise PipecError(f"--out {out} exists and is not a directory; choose another path")
    if not out.is_dir() or not any(out.iterdir()):
        return
    beside_it = f"--out {out / (schedule or 'NAME')}"
    nested = next((d for d in sorted(out.iterdir()) if (d / "plan.json").is_file()), None)
    if nested is not None:
        raise PipecError(
            f"--out {out} holds another build, {nested}; write beside it, e.g. {beside_it}"
        )
    if not (out / "plan.json").is_file():
        raise PipecError(
            f"--out {out} holds files that are not a pipec build; choose a new directory, "
            f"e.g. {beside_it}"
        )
    if not force:
        raise PipecError(f"--out {out} exists and is not empty; pass --force to replace it")


#: The temporaries emit makes beside an --out: `.NAME.tmp-PID-HEX` while printing the files,
#: `.NAME.old-PID-HEX` while the previous build is being removed.
_TEMPORARY = re.compile(r"\.(.+)\.(?:tmp|old)-(\d+)-[0-9a-f]{8}")


def os_error(e: OSError) -> str:
    """An OSError as one line for a user: its reason and the file, but never one of emit's
    temporaries (the --out it stands for instead)."""
    name = Path(os.fsdecode(e.filename)) if e.filename else None
    for part in name.parts if name else ():
        if m := _TEMPORARY.fullmatch(part):
            name = Path(str(name).split(part)[0]) / m[1]
            return f"--out {name}: {e.strerror}"
    return f"{name}: {e.strerror}" if name else str(e.strerror or e)


def _remove_stale(directory: Path) -> None:
    """Remove the temporaries that compiles killed before they could clean up left in
    `directory`: only names emit makes, and only those whose process is gone."""
    for path in directory.glob(".*.*-*-*"):
        m = _TEMPORARY.fullmatch(path.name)
        if m and path.is_dir() and not _alive(int(m[2])):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _write(directory: Path, result: CompileResult, half: int) -> None:
    for name, text in render_half(result, half).items():
        (directory / name).write_text(text)


@dataclass(frozen=True)
class Build:
    """A build directory read back: its plan, costs and parsed programs (with a model, the
    evaluation programs too)."""

    path: Path
    plan: dict
    plan_hash: str
    compiled: Compiled
    costs: CostModel
    eval_programs: tuple[Program, ...] = ()


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
        dp = int(plan.get("dp", 1))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, PipecError):
            raise
        raise PipecError(f"{plan_file}: corrupted plan ({type(e).__name__}: {e})") from None
    try:
        check_dp(dp, world)
    except PipecError as e:
        raise PipecError(f"{plan_file}: {e}; recompile") from None
    digest = plan_hash(text)

    def read(name: str, rank: int) -> Program:
        f = path / name
        if not f.is_file():
            raise PipecError(f"{f}: missing (the plan has {world} ranks); recompile the directory")
        header, program = parse_program(f.read_text(), str(f))
        expected = Header(FORMAT_VERSION, rank, world, schedule, p, m, v, digest)
        if header != expected:
            raise PipecError(
                f"{f}: header does not match plan.json (got '{header}', expected '{expected}'); "
                "recompile the directory"
            )
        return program

    programs = tuple(read(rank_file(rank), rank) for rank in range(world))
    evaluation: tuple[Program, ...] = ()
    if plan.get("model") is not None:
        evaluation = tuple(read(eval_file(rank), rank) for rank in range(world))
    compiled = Compiled(schedule, p, m, v, layout, programs)
    return Build(path, plan, digest, compiled, costs, evaluation)


def check_build(build: Build) -> SimResult:
    """What `pipec verify` proves of a build, and its re-simulation: the directory holds
    exactly the plan's files (beside any subdirectories), the programs keep the four
    invariants (and a byte limit the plan names), the evaluation programs are a valid
    forward pass, and stats.json is what simulating them gives."""
    # Directories are the user's (a run's measured/, checkpoints); files are the build's.
    present = {p.name for p in build.path.iterdir() if not p.is_dir()}
    expected = file_names(build.plan)
    stray, missing = sorted(present - expected), sorted(expected - present)
    if stray:
        raise PipecError(
            f"{build.path / stray[0]}: not a file of this build (its plan has "
            f"{build.compiled.world} ranks); remove it or recompile the directory"
        )
    if missing:
        raise PipecError(f"{build.path / missing[0]}: missing; recompile the directory")
    check_launch(build)
    c = build.compiled
    verify(c, build.costs, None, build.plan.get("memory_limit"), dp=int(build.plan.get("dp", 1)))
    if build.eval_programs:
        verify_forward(replace(c, programs=build.eval_programs))
    sim = simulate(c.layout, c.programs, build.costs)
    if build.plan.get("memory_limit_bytes") is not None:
        check_stash_bytes(sim, build.plan["memory_limit_bytes"])
    stats_file = build.path / "stats.json"
    try:
        written = json.loads(stats_file.read_text())
    except ValueError as e:
        raise PipecError(f"{stats_file}: not JSON ({e}); recompile the directory") from None
    where = _difference(written, json.loads(dump_json(stats(c, build.costs, sim))))
    if where:
        key, value, simulated = where
        raise PipecError(
            f"{stats_file}: {key} is {value}, but simulating the programs gives {simulated}; "
            "recompile the directory"
        )
    return sim


def check_launch(build: Build) -> None:
    """Raise PipecError when the build's launch.py is not the one its plan renders."""
    launch = build.path / "launch.py"
    if build.plan.get("model") is None or not launch.is_file():
        return
    if launch.read_text() != launch_text(build.plan, build.plan_hash):
        raise PipecError(
            f"{launch}: not the launch.py this plan generates (edited after compiling, or written "
            "by another pipec version); recompile the directory"
        )


def _difference(written: object, simulated: object, key: str = "") -> tuple | None:
    """Where two JSON values first differ: (key path, written value, simulated value), with
    'nothing' for a key one side lacks; None when they are equal."""
    if isinstance(written, dict) and isinstance(simulated, dict):
        for k in sorted(written.keys() | simulated.keys()):
            path = f"{key}.{k}" if key else k
            where = _difference(written.get(k, "nothing"), simulated.get(k, "nothing"), path)
            if where:
                return where
        return None
    if isinstance(written, list) and isinstance(simulated, list) and len(written) == len(simulated):
        for i, (a, b) in enumerate(zip(written, simulated)):
            where = _difference(a, b, f"{key}[{i}]")
            if where:
                return where
        return None
    return None if written == simulated else (key, json.dumps(written), json.dumps(simulated))
