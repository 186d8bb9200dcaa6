"""`pipec`: compile, simulate, show and verify pipeline schedules.

Bad input is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from codegen.render import terminal_gantt
from passes.costs import CostModel, parse_costs, parse_mem
from passes.registry import SCHEDULES, family
from passes.simulate import SimResult, simulate
from passes.verify import verify
from pipec.build_dir import emit, load
from pipec.compile import CompileResult, compile_schedule
from pipec.ir import PipecError


def _schedule_options(fn: Callable) -> Callable:
    """The options shared by `compile` and `simulate`."""
    options = [
        click.option("--schedule", "-s", required=True, help="Schedule family (see `pipec schedules`)."),
        click.option("--pp", "-p", type=int, required=True, help="Pipeline ranks p."),
        click.option("--microbatches", "-m", type=int, required=True, help="Micro-batches m."),
        click.option("--chunks", "-v", type=int, default=None, help="Chunks per rank v (default: the family's)."),
        click.option("--costs", default="", help="Per-op costs, e.g. F=1,B=1,W=1,comm=0 (F=1:2:1:1 per chunk)."),
        click.option("--mem", default="", help="Memory per op in stashes, e.g. F=1,W=-0.5 (B nets the rest)."),
        click.option("--memory-limit", type=float, default=None, help="Peak activations cap per rank, in stashes."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _compile(schedule, pp, microbatches, chunks, costs, mem, memory_limit) -> CompileResult:
    model = parse_mem(mem, parse_costs(costs)) if mem else parse_costs(costs)
    return compile_schedule(schedule, pp, microbatches, chunks, model, memory_limit)


def _rank_table(sim: SimResult) -> str:
    head = f"{'rank':>4}  {'busy':>10}  {'span':>10}  {'peak act':>9}  {'params':>6}  {'sync':>6}"
    lines = [head]
    for r, s in enumerate(sim.ranks):
        lines.append(
            f"{r:>4}  {s.busy:>10.4g}  {s.span:>10.4g}  {s.peak_activations:>9.4g}  "
            f"{s.params:>6.4g}  {s.sync:>6.4g}"
        )
    lines.append(
        f"makespan {sim.makespan:.6g}  bubble {sim.bubble:.4f}  span_bubble {sim.span_bubble:.4f}"
    )
    return "\n".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """pipec: compile pipeline-parallel schedules into verified, simulated per-rank programs."""


@cli.command()
def schedules() -> None:
    """List the schedule families with their parameters."""
    family("1f1b")  # registers the built-in families
    for name in sorted(SCHEDULES):
        fam = SCHEDULES[name]
        click.echo(f"{name:<14} v {fam.chunks:<5} {fam.summary}")


@cli.command("compile")
@_schedule_options
@click.option("--out", "-o", type=click.Path(path_type=Path), default=Path("build"), show_default=True)
@click.option("--force", is_flag=True, help="Replace a non-empty --out directory.")
def compile_cmd(out: Path, force: bool, **opts) -> None:
    """Compile a schedule into verified per-rank programs in OUT."""
    result = _compile(**opts)
    emit(result, out, force)
    sim = result.sim
    click.echo(
        f"wrote {out}/: {result.compiled.world} rank programs, plan {result.plan_hash}; "
        f"makespan {sim.makespan:.6g}, bubble {sim.bubble:.4f}, span_bubble {sim.span_bubble:.4f}"
    )


@cli.command("simulate")
@_schedule_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def simulate_cmd(as_json: bool, **opts) -> None:
    """Simulate a schedule and print per-rank figures; writes nothing."""
    result = _compile(**opts)
    if as_json:
        c = result.compiled
        out = {"schedule": c.schedule, "p": c.p, "m": c.m, "v": c.v} | result.sim.to_json()
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(_rank_table(result.sim))


@cli.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--lines", default=40, show_default=True, help="Instructions shown per rank (0: all).")
@click.option("--width", default=100, show_default=True, help="Width of the Gantt chart.")
def show(directory: Path, lines: int, width: int) -> None:
    """Print a build's programs, per-rank figures and a terminal Gantt chart."""
    build = load(directory)
    c = build.compiled
    click.echo(f"{c.schedule} p={c.p} m={c.m} v={c.v} plan {build.plan_hash}")
    for rank, program in enumerate(c.programs):
        shown = program if lines <= 0 else program[:lines]
        click.echo(f"-- rank {rank} ({len(program)} instructions)")
        click.echo("\n".join(f"  {instr}" for instr in shown))
        if len(shown) < len(program):
            click.echo(f"  ... {len(program) - len(shown)} more (--lines 0 shows all)")
    sim = simulate(c.layout, c.programs, build.costs)
    click.echo(_rank_table(sim))
    click.echo(terminal_gantt(sim, width))


@cli.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
def verify_cmd(directory: Path) -> None:
    """Check a build's programs against the invariants; exit 2 on any violation."""
    build = load(directory)
    c = build.compiled
    sim = simulate(c.layout, c.programs, build.costs)
    verify(c, build.costs, None, build.plan.get("memory_limit"))
    n = sum(len(p) for p in c.programs)
    click.echo(
        f"ok: {c.world} ranks, {n} instructions verified (coverage, dependencies, "
        f"deadlock-free matching, memory); makespan {sim.makespan:.6g}"
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI, turning every user error into one line and exit code 2."""
    try:
        cli.main(args=argv, prog_name="pipec", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("pipec: aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:
        click.echo(f"pipec: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"pipec: error: {e.format_message()}", err=True)
        sys.exit(2)
    except (PipecError, OSError) as e:
        click.echo(f"pipec: error: {e}", err=True)
        sys.exit(2)
