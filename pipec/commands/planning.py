"""`pipec plan`: profile a model, rank schedule x micro-batch size x memory strategy, and build
a row with the `pipec compile` command it prints."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipec.build_dir import check_out
from pipec.commands.compiling import DEVICE_HELP, compile_cmd
from pipec.ir import PipecError
from pipec.progress import progress

if TYPE_CHECKING:
    from pipec.plan.driver import Plan


def _csv(text: str, what: str, kind: type = str) -> list:
    """A comma-separated option as a list; one line naming the option when an item is bad."""
    try:
        return [kind(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError:
        raise PipecError(f"{what} '{text}': expected a comma-separated list, e.g. 1,2,4") from None


@click.command("plan")
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
@click.option(
    "--calibration-run/--no-calibration-run",
    default=True,
    show_default=True,
    help="Time the ops in short runs of 1F1B, ZB-H1 and the leading rows on the target ranks.",
)
@click.option(
    "--calibrate",
    "runs_done",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Fold in the finished run of a plan's BUILD (its measured/); no calibration run.",
)
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
    calibration_run: bool,
    runs_done: tuple[Path, ...],
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
    plan = _calibrated(model, plan, runs_done, out, calibration_run, threads)
    if out is None and not as_json and save_profile is None:
        click.echo(render_text(plan, top))
        return
    _plan_builds(model, plan, out, pick or 1, force, save_profile, as_json, top)


def _calibrated(
    spec: str,
    plan: Plan,
    runs_done: tuple[Path, ...],
    out: Path | None,
    calibration_run: bool,
    threads: int | None,
) -> Plan:
    """`plan` calibrated from the runs given (`--calibrate`), a finished run of the build
    `--out` replaces, and, unless runs were given or it is turned off, a calibration run on
    this machine (pipec/plan/calibration.py); `plan` itself when there is nothing to fold."""
    import os

    from pipec.build_dir import MEASURED
    from pipec.plan.conditions import current
    from pipec.plan.driver import calibrate
    from pipec.plan.observe import observe, read_run, run_conditions

    req = plan.request
    ranks = req.p * req.dp
    threads = threads or max(1, (os.cpu_count() or 1) // ranks)
    target = current(threads, ranks, req.precision, plan.profile.device)
    observed, conditions = [], None
    replaced = out is not None and (out / MEASURED / "stats.json").is_file()
    paths = [*runs_done, *([out] if replaced and out not in runs_done else [])]
    for path in paths:
        given = path in runs_done
        try:
            build, stats = read_run(path)
            observed.append(observe(plan.profile, build, stats, f"{path} (a run)"))
        except PipecError as e:
            if given:
                raise
            _say(f"not folding in the run in {path}: {e}")
            continue
        if not given:
            _say(f"folding in the run in {path}, the build --out replaces")
        ran = run_conditions(stats)
        if ran is not None and (changed := target.differences(ran)):
            _say(f"warning: the run in {path} differs from the plan's ({', '.join(changed)})")
        conditions = conditions or ran
    if calibration_run and not runs_done:
        if plan.profile.device != "cpu":
            _say("no calibration run on cuda: fold in a run with --calibrate BUILD")
        else:
            from pipec.plan.calibrate_run import calibrate_by_running

            return calibrate_by_running(spec, plan, threads, observed)
    if not observed:
        return plan
    return calibrate(plan, observed, None, conditions or target)


def _say(line: str) -> None:
    click.echo(f"pipec plan: {line}", err=True)


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
    from pipec.plan.build import command_line, run_line, shell
    from pipec.plan.report import render_json, render_text, rows
    from pipec.plan.saved import SavedProfile, save

    req = plan.request
    raw = plan.raw or plan.profile
    priced = SavedProfile(raw, req.comm_s, req.machine, req.instr_s, plan.calibration)
    saved = save(priced, save_profile, out)
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
        run = run_line(out)
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
