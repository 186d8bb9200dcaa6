"""`pipec plan`'s calibration run: short real runs on the target ranks, read as observations.

After the block profile, the plan builds plain 1F1B at the micro-batch sizes that matter
(those of the `SHORTLIST` fastest candidates and the baseline's, where plain 1F1B fits); when
a shortlisted candidate splits its backward into B and W, ZB-H1 beside each (it runs B and W
apart, as the zero-bubble families do); and the `LEADERS` fastest candidates themselves. It
trains them all in one torchrun launch on p·dp ranks with the threads per rank the run will
have, at the run's precision, `ROUNDS` turns of `STEPS` steps each (pipec/plan/calibrate_worker.py);
ranks 0 and 1 first time a message of the smallest and of the largest boundary between them,
which gives the link's latency and bandwidth. Each build's measurements become an `Observed`
(pipec/plan/observe.py). Calibrated, the plan may rank other candidates first: those of its
`LEADERS` first rows that did not run then run in a second launch (taking turns with plain 1F1B
at their sizes, as in the first), so that the rows the plan is most likely to be taken at are
priced from their own runs. The run is on the CPU (gloo).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pipec.build_dir import MEASURED, emit, load
from pipec.ir import Op, PipecError
from pipec.passes.registry import Request, build_schedule
from pipec.plan.build import compile_candidate
from pipec.plan.calibration import Observed, key
from pipec.plan.candidates import BASELINE, CompileRequest, Evaluated, evaluate_one
from pipec.plan.conditions import Conditions, current
from pipec.plan.driver import Plan
from pipec.plan.observe import merge_turns, observe
from pipec.runtime.torchrun import torchrun

WORKER = Path(__file__).with_name("calibrate_worker.py")
"""The script torchrun starts; named, never imported (it blocks SIGTERM in whoever imports it)."""
SHORTLIST = 10
"""The fastest candidates whose micro-batch sizes are calibrated."""
ROUNDS, STEPS = 4, 5
"""Turns each calibration build takes, and steps per turn (its first left out as a warm-up):
the builds alternate, so a burst of load hits them alike, and most kept steps are ones where
the CPU meter reads once (runtime/meter.py's `Sampling`), as in a long run."""
LEADERS = 3
"""The fastest candidates (by the block profile) that also run."""
SPLIT = "zb-h1"
"""The family run beside 1F1B to time B and W apart."""
SMALL_MESSAGE = 1024


def splits_backward(ev: Evaluated) -> bool:
    """Whether the candidate's programs run W apart from B."""
    orders = build_schedule(ev.schedule, Request(ev.request.p, ev.m, ev.request.v)).orders
    return any(i.op is Op.W for order in orders for i in order)


def calibration_jobs(plan: Plan) -> list[tuple[int, CompileRequest]]:
    """(mbs, compile request) of each build the calibration run trains."""
    fits = plan.evaluation.fits
    shortlist = sorted(fits, key=lambda e: e.iteration_s)[:SHORTLIST]
    if plan.baseline is not None:
        shortlist.append(plan.baseline)
    plain = {e.mbs: e for e in fits if e.family == BASELINE and e.strategy == "plain"}
    sizes = sorted({e.mbs for e in shortlist if e.mbs in plain})
    if not sizes:  # no plain 1F1B fits: the fastest candidate itself
        return [(shortlist[0].mbs, shortlist[0].request)]
    split = any(splits_backward(e) for e in shortlist)
    jobs = []
    for mbs in sizes:
        job = plain[mbs].request
        jobs.append((mbs, job))
        if split and job.m >= job.p:  # ZB-H1 needs a micro-batch per rank
            jobs.append((mbs, CompileRequest(SPLIT, job.p, job.m, 1)))
    leaders = [(e.mbs, e.request) for e in shortlist[:LEADERS]]
    return jobs + [job for job in leaders if job not in jobs]


def fit_link(times: dict[int, float]) -> tuple[float, float]:
    """(latency s, bytes per s) through the one-way times of the smallest and largest message
    (one size: the latency alone, an unlimited bandwidth)."""
    small, large = min(times), max(times)
    if large == small or times[large] <= times[small]:
        return times[small], float("inf")
    bandwidth = (large - small) / (times[large] - times[small])
    return max(0.0, times[small] - small / bandwidth), bandwidth


def _message_sizes(plan: Plan, sizes: Sequence[int]) -> list[int]:
    raw = plan.raw or plan.profile
    largest = max(b for pt in raw.points if pt.mbs in sizes for b in pt.message_bytes)
    if plan.request.precision == "bf16":
        largest //= 2
    return sorted({SMALL_MESSAGE, max(SMALL_MESSAGE, largest)})


def calibrate_by_running(
    spec: str,
    plan: Plan,
    threads: int,
    folded: Sequence[Observed] = (),
    keep: Path | None = None,
) -> Plan:
    """`plan` (uncalibrated) calibrated by the calibration run, its leaders measured (see the
    module docstring), and the finished runs `folded`; `keep`: build in this directory and
    leave the builds there."""
    from pipec.plan.driver import calibrate

    observed, link, conditions = launch(spec, plan, threads, calibration_jobs(plan), keep)
    observed = [*folded, *observed]
    calibrated = calibrate(plan, observed, link, conditions)
    ran = {(o.family, o.mbs) for o in observed}
    missing = [
        (e.mbs, e.request)
        for e in calibrated.evaluation.fits[:LEADERS]
        if (key(e), e.mbs) not in ran
    ]
    if not missing:
        return calibrated
    # Plain 1F1B at the same sizes takes turns with them, as in the first launch: a build
    # trained alone runs faster than one taking turns (docs/plan.md).
    jobs = calibration_jobs(plan)
    beside = [job for job in jobs if job[1].schedule == BASELINE and job[0] in dict(missing)]
    more, _, _ = launch(spec, plan, threads, [*missing, *beside], keep, ping=False)
    return calibrate(plan, [*observed, *more], link, conditions)


def launch(
    spec: str,
    plan: Plan,
    threads: int,
    jobs: Sequence[tuple[int, CompileRequest]],
    keep: Path | None = None,
    ping: bool = True,
) -> tuple[list[Observed], tuple[float, float] | None, Conditions]:
    """Build `jobs` ((mbs, request) priced from `plan`'s block profile), train them in one
    torchrun launch on this machine and read what they measured, with the link between ranks
    0 and 1 (`ping`) and the conditions; PipecError (one line) when the launch fails."""
    req, raw = plan.request, plan.profile
    ranks = req.p * req.dp
    conditions = current(threads, ranks, req.precision, raw.device)
    sizes = sorted({mbs for mbs, _ in jobs})
    names = ", ".join(dict.fromkeys(job.schedule for _, job in jobs))
    print(
        f"pipec plan: calibration run: {names} at mbs {', '.join(map(str, sizes))} on {ranks} "
        f"ranks x {threads} thread(s) under torchrun, {ROUNDS} turns of {STEPS} steps each",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipec-calibrate-") as tmp:
        where = Path(keep or tmp)
        builds = []
        for mbs, job in jobs:
            ev = evaluate_one(raw, job, mbs, req.comm_s, req.machine)
            out = where / f"{key(ev).replace(' ', '-')}-mbs{mbs}-m{job.m}"
            emit(compile_candidate(ev, spec, req.dp), out, force=True)
            builds.append(out)
        pings = where / "ping.json"
        args = ["--threads", str(threads), "--precision", req.precision]
        args += ["--rounds", str(ROUNDS), "--steps", str(STEPS)]
        if ping and ranks > 1:
            message = _message_sizes(plan, sizes)
            args += ["--ping", str(pings), "--ping-bytes", ",".join(map(str, message))]
        run_worker(ranks, threads, [*args, *map(str, builds)])
        observed = []
        for out, (mbs, job) in zip(builds, jobs):
            turns = [out / MEASURED / f"stats_round{k}.json" for k in range(ROUNDS)]
            stats = merge_turns([json.loads(t.read_text()) for t in turns])
            source = f"{job.schedule} mbs {mbs} (calibration run)"
            observed.append(observe(raw, load(out), stats, source))
        link = None
        if ping and ranks > 1:
            link = fit_link({int(b): t for b, t in json.loads(pings.read_text()).items()})
    print(
        f"pipec plan: calibration run took {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return observed, link, conditions


def run_worker(ranks: int, threads: int, args: Sequence[str]) -> None:
    """One torchrun launch of the worker on `ranks` ranks of `threads` threads each."""
    cmd, env = torchrun(WORKER, ranks, *args)
    env = env | {"OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        said = [ln for ln in proc.stderr.splitlines() if "pipec runtime:" in ln or "Error" in ln]
        why = said[0].strip() if said else (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise PipecError(
            f"the calibration run failed ({why}); plan without it: --no-calibration-run"
        )
