"""`pipec`: compile, simulate, show and verify pipeline schedules.

Bad input is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from codegen.partition import partition_text
from codegen.render import bytes_table, measured_table, terminal_gantt
from passes.costs import CostModel, parse_costs, parse_mem
from passes.evict import amount
from passes.placement import MAPPINGS
from passes.registry import SCHEDULES, family
from passes.residency import NEEDS_MODEL
from passes.simulate import SimResult
from passes.topology import Topology, make_topology
from pipec import __version__
from pipec.build_dir import (
    MEASURED,
    Build,
    check_build,
    check_out,
    emit,
    load,
    os_error,
    time_unit,
)
from pipec.compile import CompileResult, check_dp, compile_schedule, gc_paused
from pipec.footprint import check_fits
from pipec.interop import compile_torch_class, compile_torch_csv, export_torch_csv
from pipec.ir import Layout, PipecError
from pipec.model import compile_model
from pipec.progress import progress
from pipec.provenance import check_factory, resolve

DEVICE_HELP = (
    "Profile on this device: cpu, cuda or cuda:N, the one the build will run on (default: "
    "where the factory builds the model)."
)

if TYPE_CHECKING:
    from pipec.plan.driver import Plan


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
            default=None,
            help="Time one micro-batch's F, B, W take on one rank's share of the model (a "
            "stage of its p-way split), e.g. F=1,B=2,W=1,comm=0.1 (default F=B=W=1, comm=0); "
            "a chunk's op takes its part (1/v with v chunks per rank), so makespans compare "
            "across v. F=1:2:1:1 weighs each chunk; per=chunk: the values are per chunk op. "
            "comm: one transfer's latency; allreduce: one share's replica all-reduce.",
        ),
        click.option(
            "--mem",
            default=None,
            help="Memory per op in stashes of a rank's share, e.g. F=1,W=-0.5 (B nets the "
            "rest; a chunk's op moves its part).",
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
    device=None,
    micro_batch_size=None,
    plan_profile=None,
    split_points=None,
) -> CompileResult:
    cost_model = CostModel() if costs is None else parse_costs(costs)
    if mem is not None:
        cost_model = parse_mem(mem, cost_model)
    memory_limit, in_bytes = _memory_limit(memory_limit)
    if in_bytes and model is None:
        raise PipecError(NEEDS_MODEL)
    if sum(x is not None for x in (schedule, from_torch, from_torch_csv)) != 1:
        raise click.UsageError("give one of --schedule, --from-torch or --from-torch-csv")
    if model is None and (partition is not None or profile or split_points is not None):
        raise PipecError(
            "--partition, --split-points and --profile need a MODEL (path/to/file.py:factory)"
        )
    if partition is not None and split_points is not None:
        raise PipecError("give --partition or --split-points, not both")
    if device is not None and not profile:
        raise PipecError("--device says where --profile times the stages; add --profile")
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
    if (micro_batch_size is not None or plan_profile is not None) and model is None:
        raise PipecError(
            "--micro-batch-size and --plan-profile need a MODEL (path/to/file.py:factory)"
        )
    if plan_profile is not None:
        given = {
            "--costs": costs,
            "--mem": mem,
            "--link": link,
            "--nodes": nodes,
            "--gpus-per-node": gpus_per_node,
            "--partition": partition,
            "--split-points": split_points,
            "--profile": profile,
            "--mapping": mapping != "sequential",
            "a --memory-limit in bytes": in_bytes,
        }
        if clash := [flag for flag, value in given.items() if value]:
            raise PipecError(
                f"--plan-profile prices the build as pipec plan did (its profile, its links); "
                f"drop {', '.join(clash)}"
            )
        return _compile_planned(
            plan_profile, model, schedule, pp, microbatches, chunks, memory_limit, evict, dp,
            micro_batch_size,
        )  # fmt: skip
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
        device,
        micro_batch_size,
        split_points=tuple(split_points.split(",")) if split_points is not None else None,
    )


def _compile_planned(
    path: Path,
    spec: str,
    schedule: str,
    p: int,
    m: int,
    v: int | None,
    memory_limit: float | None,
    evict: bool,
    dp: int,
    micro_batch_size: int | None,
) -> CompileResult:
    """`--plan-profile FILE`: the build `pipec plan` prices from FILE (see pipec/plan/build.py)."""
    from pipec.plan.build import compile_planned
    from pipec.plan.candidates import CompileRequest
    from pipec.plan.saved import load as load_saved

    if micro_batch_size is None:
        raise PipecError("--plan-profile needs --micro-batch-size: which profiled size to build")
    v = family(schedule).default_v if v is None else v
    job = CompileRequest(schedule, p, m, v, memory_limit, (("evict", True),) if evict else ())
    return compile_planned(spec, load_saved(path), job, micro_batch_size, dp)


@contextmanager
def _watched(opts: dict) -> Iterator[None]:
    """Refuse a shape whose compile would not fit in memory, before building anything; report
    progress while a long one runs. A CSV's shape is its own, and bad values are refused
    where they are read."""
    p, m, v = opts["pp"], opts["microbatches"], opts["chunks"]
    name = opts["schedule"] or opts["from_torch"]
    if name is None or p is None or m is None or min(p, m, v or 1) < 1:
        yield
        return
    if v is None:
        v = family(opts["schedule"]).default_v if opts["schedule"] else 1
    need = check_fits(p, m, v)
    # With a model, capturing and measuring it is most of the time, not the schedule.
    shape = f"{name} p={p} m={m} v={v}"
    what = (
        f"compiling {opts['model']} with {shape}"
        if opts.get("model")
        else f"compiling {shape} ({need})"
    )
    with progress(what):
        yield


def _memory_limit(text: str | None) -> tuple[float | None, bool]:
    """`--memory-limit`: a plain number is stashes per rank; with a unit (40GiB) bytes."""
    if text is None:
        return None, False
    try:
        stashes = float(text)
    except ValueError:
        from pipec.plan.memory import parse_bytes

        return float(parse_bytes(text, "--memory-limit")), True
    if not 0 < stashes < math.inf:
        raise PipecError(
            f"--memory-limit must be a positive number of stashes, e.g. 5, or bytes with a "
            f"unit, e.g. 40GiB (got '{text}')"
        )
    return stashes, False


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


def _rank_table(sim: SimResult, plan: dict) -> str:
    """Per-rank figures, then makespan and bubbles, times in the plan's unit (named when it
    has one) and a note when they come from estimated costs."""
    unit, note = time_unit(plan)
    head = f"{'rank':>4}  {'busy':>10}  {'span':>10}  {'peak act':>9}  {'params':>6}  {'sync':>6}"
    if unit:
        head += f"  (times in {unit})"
    lines = [head]
    for r, s in enumerate(sim.ranks):
        lines.append(
            f"{r:>4}  {s.busy:>10.4g}  {s.span:>10.4g}  {s.peak_activations:>9.4g}  "
            f"{s.params:>6.4g}  {s.sync:>6.4g}"
        )
    lines.append(
        f"makespan {sim.makespan:.6g}{' ' + unit if unit else ''}  bubble {sim.bubble:.4f}  "
        f"span_bubble {sim.span_bubble:.4f}"
    )
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="pipec", message="%(prog)s %(version)s")
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
    "--split-points",
    default=None,
    help="With MODEL: the blocks where stages 1, 2, ... begin, e.g. layers.4,layers.8.",
)
@click.option(
    "--profile",
    is_flag=True,
    help="With MODEL: time each stage's F/B/W here instead of estimating FLOPs.",
)
@click.option("--device", default=None, help=DEVICE_HELP)
@click.option(
    "--dp",
    type=int,
    default=1,
    show_default=True,
    help="Data-parallel copies of the pipeline (world = p·dp).",
)
@click.option(
    "--micro-batch-size",
    type=click.IntRange(min=1),
    default=None,
    help="With MODEL: ask its factory for micro-batches of this size (default: its own).",
)
@click.option(
    "--plan-profile",
    type=click.Path(path_type=Path),
    default=None,
    help="With MODEL: price the build from a profile `pipec plan` saved, as the plan did.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(path_type=Path),
    default=Path("build"),
    show_default=True,
    help="Build directory to write (created; replaced only with --force).",
)
@click.option("--force", is_flag=True, help="Replace a non-empty --out directory.")
def compile_cmd(out: Path, force: bool, **opts) -> CompileResult:
    """Compile a schedule (for MODEL, path/to/file.py:factory, if given) into programs in OUT."""
    check_out(out, force, opts["schedule"])  # before the work, which may be long
    if opts["pp"] is not None:
        check_dp(opts["dp"], opts["pp"])
    # The collector's one scan of the 10^6 objects built comes after emit.
    with gc_paused(), _watched(opts):
        result = _compile(**opts)
        emit(result, out, force)
    sim = result.sim
    unit, note = time_unit(result.plan)
    click.echo(
        f"wrote {out}/: {result.compiled.world} rank programs, plan {result.plan_hash}; "
        f"makespan {sim.makespan:.6g}{' ' + unit if unit else ''}, bubble {sim.bubble:.4f}, "
        f"span_bubble {sim.span_bubble:.4f}"
    )
    if result.plan.get("model"):
        click.echo(partition_text(result.plan["model"], result.compiled.layout))
    if result.plan.get("evict"):
        click.echo(_eviction_line(sim, result.compiled.layout, result.costs, result.plan))
    if note:
        click.echo(f"note: {note}")
    return result  # `run` holds it until the process ends: freeing it is wasted time


@cli.command("simulate")
@click.argument("model", required=False)
@_schedule_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def simulate_cmd(as_json: bool, **opts) -> CompileResult:
    """Simulate a schedule (for MODEL, path/to/file.py:factory, if given); writes nothing."""
    with _watched(opts):
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
        click.echo(_rank_table(result.sim, result.plan))
        if evicted:
            click.echo(_eviction_line(result.sim, c.layout, result.costs, result.plan))
    return result  # as compile's


@cli.command()
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
    click.echo(_rank_table(sim, build.plan))
    if build.plan.get("evict"):
        click.echo(_eviction_line(sim, c.layout, build.costs, build.plan))
    click.echo(_placement_table(c.layout, build.costs.topology))
    click.echo(terminal_gantt(sim, width))
    stats = _measured(directory)
    if stats is not None:  # written by a run of OUT/launch.py
        click.echo(measured_table(stats))
        click.echo(bytes_table(_memory_rows(build, sim, stats)))
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


def _echo_planned(plan: dict, stats: dict) -> None:
    """A build `pipec plan` made: its predicted iteration time beside the measured one."""
    from pipec.plan.build import planned_line

    line = planned_line(plan, stats)
    if line is not None:
        click.echo(line)


def _memory_rows(build: Build, sim: SimResult, stats: dict | None) -> list[dict]:
    """Predicted peak bytes per rank (for the run's device: CPU unless it ran on CUDA), with
    the run's real peaks when there was one (runtime/measure.py). The factory is found as
    `pipec run` finds it, from any directory (pipec/provenance.py)."""
    from pipec.frontend import FrontendError
    from runtime.measure import memory_rows, predicted_peaks  # torch: only when asked

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


@cli.command("verify")
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
    "--precision",
    type=click.Choice(["fp32", "bf16"]),
    default="fp32",
    show_default=True,
    help="launch.py --precision to price: bf16 weights and activations, fp32 master copy.",
)
@click.option(
    "--zero",
    type=click.Choice(["0", "1"]),
    default="0",
    show_default=True,
    help="launch.py --zero to price: 1 shards masters and optimizer state over --dp.",
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
    "--time-budget",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="Profiling seconds.",
)
@click.option(
    "--runs",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Timed runs per op (median).",
)
@click.option(
    "--comm",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds per cross-rank transfer.",
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
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads while profiling (one rank's share).",
)
@click.option("--device", default=None, help=DEVICE_HELP)
@click.option("--top", type=int, default=10, show_default=True, help="Rows printed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@click.option(
    "--out",
    "-o",
    type=click.Path(path_type=Path),
    default=None,
    help="Build row --pick here, as the plan simulated it; print the torchrun command.",
)
@click.option(
    "--pick", type=click.IntRange(min=1), default=None, help="The row --out builds (default 1)."
)
@click.option("--force", is_flag=True, help="Replace a non-empty --out directory.")
@click.option(
    "--save-profile",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the profile here (default: plan-profile-DIGEST.json beside --out's build, "
    "else, with --json, in the current directory).",
)
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
    out: Path | None,
    pick: int | None,
    force: bool,
    save_profile: Path | None,
    **opts,
) -> None:
    """Profile MODEL at several micro-batch sizes; rank schedule × mbs × memory strategy."""
    from pipec.plan.candidates import PlanRequest
    from pipec.plan.driver import machine, plan_model
    from pipec.plan.memory import parse_bytes
    from pipec.plan.report import render_text

    if out is None and pick is not None:
        raise PipecError("--pick chooses the row --out builds; give --out BUILD too")
    if opts["zero"] == "1" and opts["dp"] < 2:
        raise PipecError("--zero 1 shards over data-parallel copies; give --dp 2 or more")
    if out is not None:
        check_out(out, force)  # before profiling: a typo costs no measurement
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
        opts["precision"],
        opts["zero"] == "1",
    )
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    with progress(f"planning {model} for p={opts['pp']}"):
        plan = plan_model(
            model,
            req,
            mbs=_csv(mbs, "--mbs", int),
            time_budget=opts["time_budget"],
            runs=opts["runs"],
            peak_flops=None if peak_tflops is None else peak_tflops * 1e12,
            device=opts["device"],
        )
    if out is None and not as_json and save_profile is None:
        click.echo(render_text(plan, top))
        return
    _plan_builds(model, plan, out, pick or 1, force, save_profile, as_json, top)


def _plan_builds(
    spec: str,
    plan: Plan,
    out: Path | None,
    pick: int,
    force: bool,
    save_profile: Path | None,
    as_json: bool,
    top: int,
) -> None:
    """Save the plan's profile, give every row its `pipec compile` command line, and with
    `out` build row `pick` by running its command line: the printed command is the build."""
    from pipec.plan.build import command_line, shell, torchrun_line
    from pipec.plan.report import render_json, render_text, rows
    from pipec.plan.saved import SavedProfile, save

    req = plan.request
    saved = save(SavedProfile(plan.profile, req.comm_s, req.machine), save_profile, out)
    if not as_json:
        click.echo(render_text(plan, top, (1, pick) if out is not None else (1,)))
        click.echo(f"profile saved to {saved} (pipec compile --plan-profile builds from it)")
    built = None
    if out is not None:
        table = rows(plan)
        if pick > len(table):
            raise PipecError(
                f"--pick {pick}: {len(table)} candidate(s) fit; pick 1 to {len(table)}"
            )
        ev = table[pick - 1].ev
        argv = command_line(ev, spec, saved, req.dp, out, force)
        # --json: the compile's message goes to stderr, so stdout stays one JSON object.
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            compile_cmd.main(args=argv[2:], prog_name="pipec compile", standalone_mode=False)
        run = torchrun_line(out, req.p * req.dp)
        built = {"pick": pick, "out": str(out), "command": shell(argv), "torchrun": run}
        if not as_json:
            click.echo(
                f"built row {pick} ({ev.schedule} {ev.strategy}, mbs {ev.mbs}, m {ev.m}) as:\n"
                f"  {shell(argv)}\nrun it:\n  {run}"
            )
    if as_json:
        build_dir = out or Path("build")
        report = render_json(
            plan, lambda e: shell(command_line(e, spec, saved, req.dp, build_dir))
        ) | ({"build": built} if built else {})
        click.echo(json.dumps(report, sort_keys=True))


@cli.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--nproc", type=int, default=None, help="Ranks on this machine (default: P·D).")
@click.argument("launch_args", nargs=-1, type=click.UNPROCESSED)
def run_cmd(directory: Path, nproc: int | None, launch_args: tuple[str, ...]) -> None:
    """Train a build under torchrun here (LAUNCH_ARGS go to its launch.py, e.g. --steps 30);
    on failure the rank's one-line message is repeated last and its exit code returned."""
    from runtime.torchrun import run_build

    code = run_build(directory, nproc, launch_args)
    if code:
        sys.exit(code)


@cli.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["torch-csv"]), default="torch-csv")
@click.option("--out", "-o", required=True, help="File to write ('-': standard output).")
@click.option("--comms", is_flag=True, help="Add sends, receives, REDUCE_GRAD (compute_comms).")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.option("--torchtitan", is_flag=True, help="Also torchtitan's settings (.torchtitan.toml).")
def export(directory: Path, fmt: str, out: str, comms: bool, force: bool, torchtitan: bool) -> None:
    """Write a build's programs in torch.distributed.pipelining's per-rank action CSV."""
    if out != "-" and Path(out).exists() and not force:
        raise PipecError(f"--out {out} exists; pass --force to replace it, or name a new file")
    if torchtitan:
        from pipec.torchtitan import export_torchtitan

        click.echo(export_torchtitan(directory, out, comms))
        return
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
    except PipecError as e:
        click.echo(f"pipec: error: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        click.echo(f"pipec: error: {os_error(e)}", err=True)
        sys.exit(2)


def _terminated(signum: int, frame: object) -> NoReturn:
    click.echo("pipec: terminated", err=True)
    sys.exit(128 + signum)


def run() -> NoReturn:
    """The `pipec` command: `main()` with the collector paused, then an exit that leaves the
    heap to the operating system.

    A large compile holds 10^6 objects when its files are written. Freeing them one by one,
    the collector's scan of them and the interpreter's shutdown took another 1.0-1.5 s of a
    4.8 s `pipec compile` at p=64, m=1024. Exit handlers still run; open files are flushed.
    SIGTERM exits as an exception would (status 143), so a half-written build is removed.
    """
    signal.signal(signal.SIGTERM, _terminated)
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
