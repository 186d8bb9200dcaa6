"""`pipec compile` and `pipec simulate`: the options they share and the one function that turns
them into a compiled schedule (with or without a model, or an imported torch order)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import click

from pipec.build_dir import check_out, emit, time_unit
from pipec.codegen.partition import partition_text
from pipec.commands.tables import eviction, eviction_line, rank_table
from pipec.compile import CompileResult, check_dp, compile_schedule, gc_paused
from pipec.footprint import check_fits
from pipec.interop import compile_torch_class, compile_torch_csv
from pipec.ir import PipecError
from pipec.model import compile_model
from pipec.passes.costs import CostModel, parse_costs, parse_mem
from pipec.passes.placement import MAPPINGS
from pipec.passes.registry import family
from pipec.passes.residency import NEEDS_MODEL
from pipec.passes.topology import make_topology
from pipec.progress import progress
from pipec.run_checks import check_trains_at
from pipec.terminal import printable

DEVICE_HELP = (
    "Profile on this device: cpu, cuda or cuda:N, the one the build will run on (default: "
    "where the factory builds the model)."
)


#: Micro-batches per pipeline rank when -m is not given: at m = 4p 1F1B idles (p-1)/(5p-1) of
#: its time, under a fifth (GPipe's paper draws the same line).
DEFAULT_M_PER_RANK = 4


def _default_m(opts: dict) -> dict:
    """`opts` with -m at its default where p is given and nothing else sets m (a CSV does)."""
    if opts["microbatches"] is None and opts["pp"] is not None and not opts["from_torch_csv"]:
        opts = opts | {"microbatches": DEFAULT_M_PER_RANK * opts["pp"]}
        click.echo(
            f"pipec: -m not given: {opts['microbatches']} micro-batches ({DEFAULT_M_PER_RANK}p)",
            err=True,
        )
    return opts


def _schedule_options(fn: Callable) -> Callable:
    """The options shared by `compile` and `simulate`."""
    options = [
        click.option("--schedule", "-s", help="Schedule family (see `pipec schedules`)."),
        click.option("--from-torch", metavar="CLASS", help="Or torch's order, e.g. Schedule1F1B."),
        click.option("--from-torch-csv", type=Path, help="Or a torch per-rank action CSV."),
        click.option("--pp", "-p", type=int, help="Pipeline ranks p (a CSV gives its own)."),
        click.option(
            "--microbatches",
            "-m",
            type=int,
            help=f"Micro-batches m (ditto; default {DEFAULT_M_PER_RANK}p).",
        ),
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
    precision="fp32",
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
    if precision != "fp32" and (model is None or schedule is None):
        raise PipecError(
            f"--precision {precision} prices a MODEL's stash bytes; compile a MODEL "
            "(path/to/file.py:factory) with --schedule, or drop --precision"
        )
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
            "--precision": precision != "fp32",
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
    result = compile_model(
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
        precision=precision,
    )
    if precision != "fp32":  # the plan says it trains at it: `pipec run` then checks nothing
        check_trains_at(model, result.plan["model"], precision)
    return result


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


@click.command("compile")
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
    "--precision",
    type=click.Choice(["fp32", "bf16"]),
    default="fp32",
    show_default=True,
    help="With MODEL: launch.py --precision to price stash bytes at (bf16: half an fp32 "
    "model's); a byte --memory-limit holds for it.",
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
    opts = _default_m(opts)
    if opts["pp"] is not None:
        check_dp(opts["dp"], opts["pp"])
    # The collector's one scan of the 10^6 objects built comes after emit.
    with gc_paused(), _watched(opts):
        result = _compile(**opts)
        emit(result, out, force)
    sim = result.sim
    unit, note = time_unit(result.plan)
    click.echo(
        f"wrote {printable(str(out))}/: {result.compiled.world} rank programs, plan "
        f"{result.plan_hash}; "
        f"makespan {sim.makespan:.6g}{' ' + unit if unit else ''}, bubble {sim.bubble:.4f}, "
        f"span_bubble {sim.span_bubble:.4f}"
    )
    if result.plan.get("model"):
        click.echo(partition_text(result.plan["model"], result.compiled.layout))
    if result.plan.get("evict"):
        click.echo(eviction_line(sim, result.compiled.layout, result.costs, result.plan))
    if note:
        click.echo(f"note: {note}")
    return result  # `run` holds it until the process ends: freeing it is wasted time


@click.command("simulate")
@click.argument("model", required=False)
@_schedule_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
def simulate_cmd(as_json: bool, **opts) -> CompileResult:
    """Simulate a schedule (for MODEL, path/to/file.py:factory, if given); writes nothing."""
    opts = _default_m(opts)
    with _watched(opts):
        result = _compile(**opts)
    evicted, c = result.plan.get("evict"), result.compiled
    if as_json:
        out = {"schedule": c.schedule, "p": c.p, "m": c.m, "v": c.v} | result.sim.to_json()
        if evicted:
            out |= eviction(result.sim, c.layout, result.costs, result.plan)
        if "mapping" in result.plan:
            out["mapping"] = result.plan["mapping"]
        click.echo(json.dumps(out, sort_keys=True))
    else:
        click.echo(rank_table(result.sim, result.plan))
        if evicted:
            click.echo(eviction_line(result.sim, c.layout, result.costs, result.plan))
    return result  # as compile's
