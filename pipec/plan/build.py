"""Build a plan's candidate for its model: the very programs the plan simulated, runnable.

`pipec compile MODEL` prices a build from the frontend's FLOP estimate; lowering orders sends
and the eviction pass picks its moves by simulated times, so a build priced that way can hold
other programs than the candidate the plan ranked. Here the build keeps the plan's own cost
model (the profiled per-chunk F/B/W and stash bytes at the candidate's micro-batch size, times
converted to ms, the unit of model builds), beside the model section the runtime needs to
rebuild the stages: the chunks the profile priced (blocks per stage), the factory asked for the
candidate's micro-batch size. The model section also records the plan's prediction, which
`pipec show` puts beside a run's measured iteration time.

`pipec plan --out` builds a row by running the `pipec compile --plan-profile` command line it
prints (`command_line`), so the two are one path: the same saved profile, the same functions.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from pipec.compile import CompileResult, compile_schedule
from pipec.ir import PipecError
from pipec.model import MS_PER_S, model_plan
from pipec.passes.costs import CostModel
from pipec.passes.topology import Link
from pipec.plan.candidates import CompileRequest, Evaluated, at_size, evaluate_one
from pipec.plan.saved import SavedProfile

COST_SOURCE = "pipec plan profile"


def in_ms(costs: CostModel) -> CostModel:
    """The plan's cost model (seconds) in ms: durations scale, bandwidths per ms shrink."""

    def link(k: Link) -> Link:
        return Link(k.bandwidth / MS_PER_S, k.latency * MS_PER_S)

    topo = costs.topology
    return replace(
        costs,
        F=tuple(x * MS_PER_S for x in costs.F),
        B=tuple(x * MS_PER_S for x in costs.B),
        W=tuple(x * MS_PER_S for x in costs.W),
        comm=costs.comm * MS_PER_S,
        allreduce=costs.allreduce * MS_PER_S,
        instr_overhead=costs.instr_overhead * MS_PER_S,
        topology=None
        if topo is None
        else replace(topo, intra=link(topo.intra), inter=link(topo.inter)),
    )


def compile_candidate(
    ev: Evaluated,
    spec: str,
    dp: int = 1,
    profile_digest: str | None = None,
    saved: SavedProfile | None = None,
) -> CompileResult:
    """Compile `ev` for the model of `spec`, its factory asked for micro-batches of `ev.mbs`
    (`dp` data-parallel copies add each stage's gradient all-reduce, which the plan does not
    price; `profile_digest` names the saved profile, recorded beside the prediction with the
    conditions its times were measured under and its expected error, from `saved`)."""
    job = ev.request
    partition = ",".join(map(str, ev.chunks.counts))
    model = model_plan(spec, ev.layout, partition, profile=False, micro_batch_size=ev.mbs)
    model["cost"]["source"] = COST_SOURCE
    model["planned"] = {
        "schedule": ev.schedule,
        "strategy": ev.strategy,
        "mbs": ev.mbs,
        "iteration_s": ev.iteration_s,
        "peak_bytes": ev.peak_bytes,
        "profile": profile_digest,
    }
    if saved is not None:
        conditions = saved.conditions
        model["planned"] |= {
            "conditions": None if conditions is None else conditions.to_json(),
            "expected_error": None if saved.calibration is None else saved.calibration.error,
        }
    return compile_schedule(
        job.schedule,
        job.p,
        job.m,
        job.v,
        in_ms(ev.costs),
        job.memory_limit,
        model=model,
        dp=dp,
        **dict(job.options),
    )


def compile_planned(
    spec: str, saved: SavedProfile, job: CompileRequest, mbs: int, dp: int = 1
) -> CompileResult:
    """`pipec compile MODEL --plan-profile FILE`: `job` at `mbs`, priced, simulated and built
    as `pipec plan` does it from the profile in FILE. The build cuts the model into the
    chunks the profile priced, so a profile of another model fails there (its blocks)."""
    if saved.machine is not None and saved.machine.world != job.p:
        raise PipecError(
            f"the plan profile prices links for {saved.machine.world} ranks "
            f"({saved.machine.nodes} node(s) x {saved.machine.gpus_per_node}); compile with "
            f"--pp {saved.machine.world}, or plan again for {job.p}"
        )
    return compile_candidate(planned_row(saved, job, mbs), spec, dp, saved.digest, saved)


def planned_row(saved: SavedProfile, job: CompileRequest, mbs: int) -> Evaluated:
    """`job` at `mbs` priced as the plan that saved `saved` priced its row: from the
    calibrated profile, with the runtime's cost per instruction at `mbs` and the schedule's
    correction."""
    instr_s = at_size(saved.instr_s, mbs)
    ev = evaluate_one(saved.priced, job, mbs, saved.comm_s, saved.machine, instr_s)
    return ev if saved.calibration is None else saved.calibration.corrected(ev)


def command_line(
    ev: Evaluated, spec: str, profile: Path, dp: int, out: Path, force: bool = False
) -> list[str]:
    """The `pipec compile` arguments that build `ev` from the saved `profile` into `out`."""
    job = ev.request
    argv = [
        "pipec", "compile", spec,
        "--schedule", job.schedule,
        "--pp", str(job.p),
        "--microbatches", str(job.m),
        "--chunks", str(job.v),
        "--micro-batch-size", str(ev.mbs),
        "--plan-profile", str(profile),
    ]  # fmt: skip
    if job.memory_limit is not None:
        argv += ["--memory-limit", repr(job.memory_limit)]  # repr: the float, exactly
    for key, value in job.options:  # compile_schedule's keywords are compile's options
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    if dp > 1:
        argv += ["--dp", str(dp)]
    return [*argv, "--out", str(out), *(["--force"] if force else [])]


def shell(argv: list[str]) -> str:
    return shlex.join(argv)


def run_line(out: Path) -> str:
    """How to train the build: `pipec run` checks its options and the build first and starts
    torchrun with its rendezvous on 127.0.0.1 (runtime/torchrun.py)."""
    return shell(["pipec", "run", str(out)])


def planned_line(plan: dict, stats: dict) -> str | None:
    """The plan's predicted iteration time beside a run's measured one (None: the build did
    not come from a plan)."""
    planned = (plan.get("model") or {}).get("planned")
    if planned is None:
        return None
    predicted = planned["iteration_s"] * MS_PER_S
    measured = stats["measured"]["iteration_ms"]
    error = planned.get("expected_error")
    expected = "uncalibrated" if error is None else f"the plan expected within {error:.1%}"
    return (
        f"plan ({planned['schedule']} {planned['strategy']}, mbs {planned['mbs']}): iteration "
        f"{predicted:.2f} ms predicted vs {measured:.2f} ms measured "
        f"(x{measured / predicted:.2f}; {expected})"
    )
