"""The commands that take a build directory: `show`, `verify`, `run` and `export`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from pipec.build_dir import MEASURED, Build, check_build, load
from pipec.codegen.partition import partition_text
from pipec.codegen.render import bytes_table, measured_table, op_kinds_line, terminal_gantt
from pipec.commands.tables import eviction_line, placement_table, rank_table
from pipec.interop import export_torch_csv
from pipec.ir import PipecError
from pipec.passes.simulate import SimResult
from pipec.provenance import check_factory, resolve
from pipec.terminal import printable


@click.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--lines",
    type=click.IntRange(min=0),
    default=40,
    show_default=True,
    help="Instructions shown per rank (0: all).",
)
@click.option(
    "--width",
    type=click.IntRange(min=10, max=10000),
    default=100,
    show_default=True,
    help="Columns of the Gantt chart.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the figures as JSON instead (per rank: predicted and real peak bytes).",
)
def show(directory: Path, lines: int, width: int, as_json: bool) -> None:
    """Print a build's programs, per-rank figures and a terminal Gantt chart; after a run, the
    measured figures and the predicted vs real peak bytes per rank. Exit 2 when the verifier
    finds the build broken (after its programs, which show where)."""
    build = load(directory)
    c = build.compiled
    if as_json:
        sim = _checked(build)
        click.echo(json.dumps(_show_json(build, sim, _measured(directory)), sort_keys=True))
        return
    click.echo(f"{c.schedule} p={c.p} m={c.m} v={c.v} plan {build.plan_hash}")
    if build.plan.get("model"):
        click.echo(partition_text(build.plan["model"], c.layout))
    for rank, program in enumerate(c.programs):
        shown = program if lines <= 0 else program[:lines]
        click.echo(f"-- rank {rank} ({len(program)} instructions)")
        click.echo("\n".join(f"  {instr}" for instr in shown))
        if len(shown) < len(program):
            click.echo(f"  ... {len(program) - len(shown)} more (--lines 0 shows all)")
    sim = _checked(build)
    click.echo(rank_table(sim, build.plan))
    if build.plan.get("evict"):
        click.echo(eviction_line(sim, c.layout, build.costs, build.plan))
    click.echo(placement_table(c.layout, build.costs.topology))
    click.echo(terminal_gantt(sim, width))
    stats = _measured(directory)
    if stats is not None:  # written by a run of OUT/launch.py
        click.echo(measured_table(stats))
        _echo_op_kinds(build, stats)
    if build.plan.get("model"):  # the prediction, beside the real peaks after a run
        click.echo(bytes_table(_memory_rows(build, sim, stats)))
    if stats is not None:
        _echo_planned(build.plan, stats)


def _measured(directory: Path) -> dict | None:
    measured = directory / MEASURED / "stats.json"
    return json.loads(measured.read_text()) if measured.is_file() else None


def _checked(build: Build) -> SimResult:
    """`check_build`'s simulation, or a PipecError saying the build is broken and why."""
    try:
        return check_build(build)
    except PipecError as e:
        raise PipecError(f"this build is broken: {e}") from None


def _echo_op_kinds(build: Build, stats: dict) -> None:
    """Which op kinds the run measured more than 10% off the costs the build was priced with
    (not for FLOP estimates, which are no prediction of time)."""
    from pipec.runtime.measure import kind_ratios

    if stats["simulated"]["cost_source"] == "estimate" or not stats.get("ops"):
        return
    click.echo(op_kinds_line(kind_ratios(stats, build.compiled, build.costs)))


def _echo_planned(plan: dict, stats: dict) -> None:
    """A build `pipec plan` made: its predicted iteration time beside the measured one, and
    whether the run's conditions differ from those the plan's times were measured under."""
    from pipec.plan.build import planned_line
    from pipec.plan.conditions import Conditions, notice

    line = planned_line(plan, stats)
    if line is not None:
        click.echo(line)
    if stats.get("conditions"):
        said = notice(
            (plan.get("model") or {}).get("planned"), Conditions.from_json(stats["conditions"])
        )
        if said:
            click.echo(f"warning: {said}")


def _memory_rows(build: Build, sim: SimResult, stats: dict | None) -> list[dict]:
    """Predicted peak bytes per rank (for the run's device: CPU unless it ran on CUDA), with
    the run's real peaks when there was one (runtime/measure.py). The factory is found as
    `pipec run` finds it, from any directory (pipec/provenance.py)."""
    from pipec.frontend import FrontendError
    from pipec.runtime.measure import memory_rows, predicted_peaks  # torch: only when asked

    device, backend = (stats.get("device", "cpu"), stats.get("backend")) if stats else ("cpu", None)
    spec = resolve(build.plan["model"], None, build.path)
    run = stats or build.plan  # the run's precision and ZeRO, else the plan's
    precision, zero = run.get("precision", "fp32"), run.get("zero", 1)
    try:
        peaks = predicted_peaks(
            build.plan, build.compiled, build.costs, sim, device, backend, spec, precision, zero
        )
    except FrontendError as e:
        raise PipecError(f"{build.path}: {e}") from None
    return memory_rows(peaks, stats)


def _show_json(build: Build, sim: SimResult, stats: dict | None) -> dict:
    """`pipec show --json`: the simulated figures and, per rank, predicted and real peak bytes
    (real only after a run), with the run's measured figures."""
    c = build.compiled
    out = {
        "schedule": c.schedule,
        "p": c.p,
        "m": c.m,
        "v": c.v,
        "plan": build.plan_hash,
        "simulated": sim.to_json(),
        "measured": None if stats is None else stats["measured"] | {"device": stats["device"]},
    }
    if build.plan.get("model") is not None:
        out["ranks"] = _memory_rows(build, sim, stats)
    return out


@click.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
def verify_cmd(directory: Path) -> None:
    """Check a build: exactly the plan's files, the invariants, and stats.json against a
    re-simulation; exit 2 on any violation."""
    build = load(directory)
    sim = check_build(build)
    if build.plan.get("model") is not None:  # the factory a run would import
        check_factory(build.plan["model"], build.path)
    c = build.compiled
    n = sum(len(p) for p in c.programs)
    click.echo(
        f"ok: {c.world} ranks, {n} instructions verified (coverage, dependencies, "
        f"deadlock-free matching, memory; files and stats.json"
        + (", and the evaluation programs" if build.eval_programs else "")
        + f"); makespan {sim.makespan:.6g}"
    )


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--nproc", type=int, default=None, help="Ranks on this machine (default: P·D).")
@click.option(
    "--max-restarts",
    type=int,
    default=0,
    metavar="N",
    help="Restart the ranks after a failure, up to N times, from the newest checkpoint of "
    "--save (default 0).",
)
@click.argument("launch_args", nargs=-1, type=click.UNPROCESSED)
def run_cmd(
    directory: Path, nproc: int | None, max_restarts: int, launch_args: tuple[str, ...]
) -> None:
    """Train a build under torchrun here (LAUNCH_ARGS go to its launch.py, e.g. --steps 30);
    on failure the rank's one-line message is repeated last and its exit code returned."""
    from pipec.runtime.torchrun import run_build

    code = run_build(directory, nproc, launch_args, max_restarts)
    if code:
        sys.exit(code)


@click.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["torch-csv"]), default="torch-csv")
@click.option("--out", "-o", required=True, help="File to write ('-': standard output).")
@click.option("--comms", is_flag=True, help="Add sends, receives, REDUCE_GRAD (compute_comms).")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.option(
    "--torchtitan",
    is_flag=True,
    help="Also torchtitan's settings beside it (.torchtitan.args; for 0.2, .torchtitan.toml).",
)
@click.option(
    "--torchtitan-version",
    metavar="X.Y",
    help="The torchtitan to write for (default: the installed one; 0.2 or 0.3).",
)
@click.option(
    "--torchtitan-names",
    metavar="OURS=THEIRS,...",
    help="Module renames into torchtitan's (tok_embeddings, layers, norm, head), over the "
    "built-in ones for Llama-style names.",
)
def export(
    directory: Path,
    fmt: str,
    out: str,
    comms: bool,
    force: bool,
    torchtitan: bool,
    torchtitan_version: str | None,
    torchtitan_names: str | None,
) -> None:
    """Write a build's programs in torch.distributed.pipelining's per-rank action CSV."""
    if out != "-" and Path(out).exists() and not force:
        raise PipecError(f"--out {out} exists; pass --force to replace it, or name a new file")
    if torchtitan:
        from pipec.torchtitan import export_torchtitan

        click.echo(export_torchtitan(directory, out, comms, torchtitan_version, torchtitan_names))
        return
    if torchtitan_version or torchtitan_names:
        raise PipecError("--torchtitan-version and --torchtitan-names go with --torchtitan")
    text = export_torch_csv(directory, comms)
    if out == "-":
        click.echo(text, nl=False)
        return
    Path(out).write_text(text, newline="")
    kind = "compute_comms" if comms else "compute_only"
    click.echo(
        f"wrote {printable(str(out))}: {fmt}, for _PipelineScheduleRuntime._load_csv(path, "
        f"format='{kind}')"
    )
