"""`pipec`: compile, simulate, show and verify pipeline schedules.

Bad input is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import click

from codegen.render import bytes_table, measured_table, terminal_gantt
from passes.costs import CostModel, parse_costs, parse_mem
from passes.evict import amount
from passes.placement import MAPPINGS
from passes.registry import SCHEDULES, family
from passes.residency import NEEDS_MODEL, check_stash_bytes
from passes.simulate import SimResult, simulate
from passes.topology import Topology, make_topology
from passes.verify import verify
from pipec.build_dir import emit, load
from pipec.compile import CompileResult, compile_schedule, gc_paused
from pipec.interop import compile_torch_class, compile_torch_csv, export_torch_csv
from pipec.ir import Layout, PipecError
from pipec.model import compile_model


def _schedule_options(fn: Callable) -> Callable:
    """The options shared by `compile` and `simulate`."""
    options = [
        click.option("--schedule", "-s", help="Schedule family (see `pipec schedules`)."),
        click.option("--from-torch", metavar="CLASS", help="Or torch's order, e.g. Schedule1F1B."),
        click.option("--from-torch-csv", type=Path, help="Or a torch per-rank action CSV."),
        click.option("--pp", "-p", type=int, help="Pipeline ranks p (a CSV gives its own)."),
        click.option("--microbatches", "-m", type=int, help="Micro-batches m (ditto)."),
        click.option(
            "--chunks",
            "-v",
            type=int,
            default=None,
            help="Chunks per rank v (default: the family's).",
        ),
        click.option(
            "--costs",
            default="",
            help="Per-op costs, e.g. F=1,B=1,W=1,comm=0 (F=1:2:1:1 per chunk).",
        ),
        click.option(
            "--mem",
            default="",
            help="Memory per op in stashes, e.g. F=1,W=-0.5 (B nets the rest).",
        ),
        click.option(
            "--memory-limit",
            default=None,
            help="Peak activations cap per rank: stashes (5), or with MODEL bytes of stash "
            "(40GiB); --evict evicts down to it.",
        ),
        click.option(
            "--evict",
            is_flag=True,
            help="BPipe: evict stashes to a partner rank to meet --memory-limit (alone: the "
            "smallest feasible limit).",
        ),
        click.option(
            "--nodes", type=int, default=None, help="Nodes the pipeline spans (one rank per GPU)."
        ),
        click.option(
            "--gpus-per-node",
            type=int,
            default=None,
            help="GPUs per node (default: --pp / --nodes).",
        ),
        click.option(
            "--link",
            default="",
            help="Links as BANDWIDTH:LATENCY (stashes per time unit : time), e.g. "
            "intra=4:0.01,inter=0.4:0.05.",
        ),
        click.option(
            "--mapping",
            type=click.Choice(MAPPINGS),
            default="sequential",
            show_default=True,
            help="Rank-to-device placement; auto keeps the fastest.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _compile(
    schedule,
    from_torch,
    from_torch_csv,
    pp,
    microbatches,
    chunks,
    costs,
    mem,
    memory_limit,
    evict,
    nodes,
    gpus_per_node,
    link,
    mapping,
    model=None,
    partition=None,
    profile=False,
    dp=1,
) -> CompileResult:
    cost_model = parse_mem(mem, parse_costs(costs)) if mem else parse_costs(costs)
    memory_limit, in_bytes = _memory_limit(memory_limit)
    if in_bytes and model is None:
        raise PipecError(NEEDS_MODEL)
    if sum(x is not None for x in (schedule, from_torch, from_torch_csv)) != 1:
        raise click.UsageError("give one of --schedule, --from-torch or --from-torch-csv")
    if model is None and (partition is not None or profile):
        raise PipecError("--partition and --profile need a MODEL (path/to/file.py:factory)")
    if model is not None and schedule is None:
        raise PipecError(
            "a MODEL compiles with --schedule; imported torch orders take no MODEL yet"
        )
    if (evict or mapping != "sequential") and schedule is None:
        raise PipecError(
            "--evict and --mapping work with --schedule; not on imported torch orders yet"
        )
    if from_torch_csv is not None:
        return compile_torch_csv(
            from_torch_csv, cost_model, memory_limit, (pp, microbatches, chunks)
        )
    for flag, value in (("--pp", pp), ("--microbatches", microbatches)):
        if value is None:
            raise click.UsageError(f"Missing option '{flag}'.")
    cost_model = replace(cost_model, topology=make_topology(pp, nodes, gpus_per_node, link))
    if from_torch is not None:
        result, notes = compile_torch_class(
            from_torch, pp, microbatches, chunks, cost_model, memory_limit
        )
        for note in notes:
            click.echo(f"pipec: note: {note}", err=True)
        return result
    if model is None:
        return compile_schedule(
            schedule,
            pp,
            microbatches,
            chunks,
            cost_model,
            memory_limit,
            dp=dp,
            evict=evict,
            mapping=mapping,
        )
    return compile_model(
        model,
        schedule,
        pp,
        microbatches,
        chunks,
        cost_model,
        memory_limit,
        partition or "balanced",
        profile,
        dp,
        evict,
        mapping,
        in_bytes,
    )


def _memory_limit(text: str | None) -> tuple[float | None, bool]:
    """`--memory-limit`: a plain number is stashes per rank; with a unit (40GiB) bytes."""
    if text is None:
        return None, False
    try:
        return float(text), False
    except ValueError:
        from pipec.plan.memory import parse_bytes

        return float(parse_bytes(text, "--memory-limit")), True


def _eviction(sim: SimResult, layout: Layout, costs: CostModel, plan: dict) -> dict:
    """What eviction did in one iteration, for printing and for --json; with a model, the
    limit and the moved stashes also in bytes (each stash weighs its stage's stash bytes)."""
    g = costs.topology.gpus_per_node if costs.topology else None
    inter = sum(t.size for t in sim.transfers if g and t.src // g != t.dst // g)
    out = {
        "memory_limit": plan["memory_limit"],
        "evicted": sum(t.kind == "evict" for t in sim.transfers),
        "moved_stashes": round(sim.moved, 9),
        "moved_inter_node": round(inter, 9),
    }
    if costs.stash_bytes:
        chunk, share = layout.stage_chunk, layout.stash_share
        per_unit = [b / costs.mem_F / share for b in costs.stash_bytes]
        out["moved_bytes"] = round(sum(t.size * per_unit[chunk[t.stage]] for t in sim.transfers))
        out["peak_stash_bytes"] = max(r.peak_stash_bytes for r in sim.ranks)
        if "memory_limit_bytes" in plan:
            out["memory_limit_bytes"] = plan["memory_limit_bytes"]
    return out


def _eviction_line(sim: SimResult, layout: Layout, costs: CostModel, plan: dict) -> str:
    figures = _eviction(sim, layout, costs, plan)
    if "memory_limit_bytes" in figures:
        limit = f"{amount(figures['memory_limit_bytes'], True)} of stash"
    else:
        limit = f"{figures['memory_limit']:g} stashes"
    moved = f"{figures['moved_stashes']:g} stash units"
    peak = ""
    if "moved_bytes" in figures:
        moved += f" ({figures['moved_bytes']}B)"
        peak = f"; peak {amount(figures['peak_stash_bytes'], True)} of stash on a rank"
    return (
        f"evict: limit {limit} per rank; {figures['evicted']} stashes evicted and loaded back, "
        f"{moved} moved per iteration ({figures['moved_inter_node']:g} over inter-node "
        f"links){peak}"
    )


def _placement_table(layout: Layout, topology: Topology | None) -> str:
    g = topology.gpus_per_node if topology else layout.p
    lines = [f"{'stage':>5}  {'rank':>4}  {'node':>4}  {'gpu':>3}"]
    for s, r in enumerate(layout.stage_rank):
        node, gpu = divmod(r, g)
        lines.append(f"{s:>5}  {r:>4}  {node:>4}  {gpu:>3}")
    return "\n".join(lines)


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
@click.argument("model", required=False)
@_schedule_options
@click.option(
    "--partition",
    default=None,
    help="With MODEL: uniform, balanced (default) or blocks per stage, e.g. 3,2,2,1.",
)
@click.option(
    "--profile",
    is_flag=True,
    help="With MODEL: time each stage's F/B/W here instead of estimating FLOPs.",
)
@click.option(
    "--dp",
    type=int,
    default=1,
    show_default=True,
    help="Data-parallel copies of the pipeline (world = p·dp).",
)
@click.option(
    "--out", "-o", type=click.Path(path_type=Path), default=Path("build"), show_default=True
)
@click.option("--force", is_flag=True, help="Replace a non-empty --out directory.")
def compile_cmd(out: Path, force: bool, **opts) -> CompileResult:
    """Compile a schedule (for MODEL, path/to/file.py:factory, if given) into programs in OUT."""
    with gc_paused():  # the collector's one scan of the 10^6 objects built comes after emit
        result = _compile(**opts)
        emit(result, out, force)
    sim = result.sim
    click.echo(
        f"wrote {out}/: {result.compiled.world} rank programs, plan {result.plan_hash}; "
        f"makespan {sim.makespan:.6g}, bubble {sim.bubble:.4f}, span_bubble {sim.span_bubble:.4f}"
    )
    if result.plan.get("evict"):
        click.echo(_eviction_line(sim, result.compiled.layout, result.costs, result.plan))
    return result  # `run` holds it until the process ends: freeing it is wasted time


@cli.command("simulate")
@click.argument("model", required=False)
@_schedule_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def simulate_cmd(as_json: bool, **opts) -> CompileResult:
    """Simulate a schedule (for MODEL, path/to/file.py:factory, if given); writes nothing."""
    result = _compile(**opts)
    evicted, c = result.plan.get("evict"), result.compiled
    if as_json:
        out = {"schedule": c.schedule, "p": c.p, "m": c.m, "v": c.v} | result.sim.to_json()
        if evicted:
            out |= _eviction(result.sim, c.layout, result.costs, result.plan)
        if "mapping" in result.plan:
            out["mapping"] = result.plan["mapping"]
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(_rank_table(result.sim))
        if evicted:
            click.echo(_eviction_line(result.sim, c.layout, result.costs, result.plan))
    return result  # as compile's


@cli.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--lines", default=40, show_default=True, help="Instructions shown per rank (0: all)."
)
@click.option("--width", default=100, show_default=True, help="Width of the Gantt chart.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the figures as JSON instead (per rank: predicted and real peak bytes).",
)
def show(directory: Path, lines: int, width: int, as_json: bool) -> None:
    """Print a build's programs, per-rank figures and a terminal Gantt chart; after a run, the
    measured figures and the predicted vs real peak bytes per rank."""
    build = load(directory)
    c = build.compiled
    if as_json:
        click.echo(json.dumps(_show_json(build, directory), sort_keys=True))
        return
    click.echo(f"{c.schedule} p={c.p} m={c.m} v={c.v} plan {build.plan_hash}")
    for rank, program in enumerate(c.programs):
        shown = program if lines <= 0 else program[:lines]
        click.echo(f"-- rank {rank} ({len(program)} instructions)")
        click.echo("\n".join(f"  {instr}" for instr in shown))
        if len(shown) < len(program):
            click.echo(f"  ... {len(program) - len(shown)} more (--lines 0 shows all)")
    sim = simulate(c.layout, c.programs, build.costs)
    click.echo(_rank_table(sim))
    if build.plan.get("evict"):
        click.echo(_eviction_line(sim, c.layout, build.costs, build.plan))
    click.echo(_placement_table(c.layout, build.costs.topology))
    click.echo(terminal_gantt(sim, width))
    stats = _measured(directory)
    if stats is not None:  # written by a run of OUT/launch.py
        click.echo(measured_table(stats))
        click.echo(bytes_table(_memory_rows(build, sim, stats)))


def _measured(directory: Path) -> dict | None:
    measured = directory / "measured" / "stats.json"
    return json.loads(measured.read_text()) if measured.is_file() else None


def _memory_rows(build, sim: SimResult, stats: dict | None) -> list[dict]:  # type: ignore[no-untyped-def]
    """Predicted peak bytes per rank (for the run's device: CPU unless it ran on CUDA), with
    the run's real peaks when there was one (runtime/measure.py)."""
    from runtime.measure import memory_rows, predicted_peaks  # torch: only when asked

    device = stats.get("device", "cpu") if stats is not None else "cpu"
    peaks = predicted_peaks(build.plan, build.compiled, build.costs, sim, device)
    return memory_rows(peaks, stats)


def _show_json(build, directory: Path) -> dict:  # type: ignore[no-untyped-def]
    """`pipec show --json`: the simulated figures and, per rank, predicted and real peak bytes
    (real only after a run), with the run's measured figures."""
    c = build.compiled
    sim = simulate(c.layout, c.programs, build.costs)
    stats = _measured(directory)
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


@cli.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
def verify_cmd(directory: Path) -> None:
    """Check a build's programs against the invariants; exit 2 on any violation."""
    build = load(directory)
    c = build.compiled
    verify(c, build.costs, None, build.plan.get("memory_limit"))
    sim = simulate(c.layout, c.programs, build.costs)
    if build.plan.get("memory_limit_bytes") is not None:
        check_stash_bytes(sim, build.plan["memory_limit_bytes"])
    n = sum(len(p) for p in c.programs)
    click.echo(
        f"ok: {c.world} ranks, {n} instructions verified (coverage, dependencies, "
        f"deadlock-free matching, memory); makespan {sim.makespan:.6g}"
    )


def _csv(text: str, what: str, kind: type = str) -> list:
    """A comma-separated option as a list; one line naming the option when an item is bad."""
    try:
        return [kind(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError:
        raise PipecError(f"{what} '{text}': expected a comma-separated list, e.g. 1,2,4") from None


@cli.command("plan")
@click.argument("model")
@click.option("--pp", "-p", type=int, required=True, help="Pipeline ranks p.")
@click.option("--dp", type=int, default=1, show_default=True, help="Data-parallel copies.")
@click.option(
    "--global-batch", "-B", type=int, required=True, help="Samples per iteration, all copies."
)
@click.option(
    "--memory-per-device", required=True, help="Memory per device: 80GiB, 512MiB or bytes."
)
@click.option(
    "--peak-tflops", type=float, default=None, help="Device peak for MFU (default: measured GEMM)."
)
@click.option(
    "--schedules", default="", help="Families to consider, e.g. 1f1b,interleaved (default: all)."
)
@click.option(
    "--strategies", default="", help="Memory strategies, e.g. plain,recompute (default: all)."
)
@click.option(
    "--mbs", default="", help="Micro-batch sizes to profile (default: 1,2,4,… up to the batch)."
)
@click.option(
    "--time-budget", type=float, default=60.0, show_default=True, help="Profiling seconds."
)
@click.option("--runs", type=int, default=3, show_default=True, help="Timed runs per op (median).")
@click.option(
    "--comm", type=float, default=0.0, show_default=True, help="Seconds per cross-rank transfer."
)
@click.option(
    "--nodes", type=int, default=None, help="Nodes the pipeline spans (one rank per GPU)."
)
@click.option(
    "--gpus-per-node", type=int, default=None, help="GPUs per node (default: --pp / --nodes)."
)
@click.option(
    "--link",
    default="",
    help="Links as BYTES_PER_S:SECONDS, e.g. intra=450e9:5e-6,inter=50e9:1e-5.",
)
@click.option(
    "--threads", type=int, default=None, help="CPU threads while profiling (one rank's share)."
)
@click.option("--top", type=int, default=10, show_default=True, help="Rows printed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def plan_cmd(
    model: str,
    memory_per_device: str,
    peak_tflops: float | None,
    schedules: str,
    strategies: str,
    mbs: str,
    threads: int | None,
    top: int,
    as_json: bool,
    **opts,
) -> None:
    """Profile MODEL at several micro-batch sizes; rank schedule × mbs × memory strategy."""
    from pipec.plan.candidates import PlanRequest
    from pipec.plan.driver import machine, plan_model
    from pipec.plan.memory import parse_bytes
    from pipec.plan.report import render_json, render_text

    topology = machine(opts["pp"], opts["nodes"], opts["gpus_per_node"], opts["link"], opts["comm"])
    req = PlanRequest(
        opts["pp"],
        opts["global_batch"],
        parse_bytes(memory_per_device),
        opts["dp"],
        tuple(_csv(schedules, "--schedules")),
        tuple(_csv(strategies, "--strategies")),
        opts["comm"],
        topology,
    )
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    plan = plan_model(
        model,
        req,
        mbs=_csv(mbs, "--mbs", int),
        time_budget=opts["time_budget"],
        runs=opts["runs"],
        peak_flops=None if peak_tflops is None else peak_tflops * 1e12,
    )
    click.echo(json.dumps(render_json(plan), sort_keys=True) if as_json else render_text(plan, top))


@cli.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["torch-csv"]), default="torch-csv")
@click.option("--out", "-o", required=True, help="File to write ('-': standard output).")
@click.option("--comms", is_flag=True, help="Add sends, receives, REDUCE_GRAD (compute_comms).")
def export(directory: Path, fmt: str, out: str, comms: bool) -> None:
    """Write a build's programs in torch.distributed.pipelining's per-rank action CSV."""
    text = export_torch_csv(directory, comms)
    if out == "-":
        click.echo(text, nl=False)
        return
    Path(out).write_text(text, newline="")
    kind = "compute_comms" if comms else "compute_only"
    click.echo(f"wrote {out}: {fmt}, for _PipelineScheduleRuntime._load_csv(path, format='{kind}')")


def main(argv: list[str] | None = None) -> object:
    """Run the CLI, turning every user error into one line and exit code 2; returns what the
    command returned (`compile`: its CompileResult)."""
    try:
        return cli.main(args=argv, prog_name="pipec", standalone_mode=False)
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


def run() -> NoReturn:
    """The `pipec` command: `main()` with the collector paused, then an exit that leaves the
    heap to the operating system.

    A large compile holds 10^6 objects when its files are written. Freeing them one by one,
    the collector's scan of them and the interpreter's shutdown took another 1.0-1.5 s of a
    4.8 s `pipec compile` at p=64, m=1024. Exit handlers still run; open files are flushed.
    """
    with gc_paused():
        try:
            kept = main()  # noqa: F841 - held, not freed, until the process ends
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
