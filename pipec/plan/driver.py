"""The plan driver: check the batch arithmetic, profile, evaluate, pick the baseline.

`plan_model` profiles a model factory and plans; `plan_profile` plans from a profile that is
already at hand (tests inject synthetic MFU curves through it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipec.codegen.render import format_bytes
from pipec.ir import PipecError
from pipec.passes.topology import Topology, make_topology
from pipec.plan.calibration import Calibration, Observed, fold
from pipec.plan.candidates import (
    BASELINE,
    Evaluated,
    Evaluation,
    PlanRequest,
    evaluate,
    schedule_names,
    strategy_names,
)
from pipec.plan.conditions import Conditions
from pipec.plan.facts import ModelProfile
from pipec.plan.ranking import ranked

LINK_EXAMPLE = "--link intra=450e9:5e-6,inter=50e9:1e-5"


def machine(
    p: int, nodes: int | None, gpus_per_node: int | None, links: str, comm_s: float = 0.0
) -> Topology | None:
    """The machine `--nodes/--gpus-per-node/--link` describe, as `pipec compile` reads them
    (rank r on GPU r % G of node r // G) but in real units: link bandwidths in bytes per
    second and latencies in seconds, since the plan prices transfers of measured bytes."""
    if (nodes is not None or gpus_per_node is not None) and not links:
        raise PipecError(
            "--nodes/--gpus-per-node price transfers by the links they cross: give "
            f"BYTES_PER_S:SECONDS for each, e.g. {LINK_EXAMPLE}"
        )
    if links and comm_s:
        raise PipecError("--comm and --link both price transfers; give one of them")
    return make_topology(p, nodes, gpus_per_node, links)


@dataclass(frozen=True)
class Plan:
    """A finished plan: the request, the profile it priced with, every candidate (those that
    fit in the order the report lists them, ties simplest first: pipec/plan/ranking.py), the
    1F1B baseline (plain 1F1B at the largest micro-batch size that fits; None when none
    does), each fitting row's place, and the calibration when the plan has one (its
    `profile` then the block profile scaled by it, `raw` the block profile)."""

    request: PlanRequest
    profile: ModelProfile
    evaluation: Evaluation
    baseline: Evaluated | None
    places: tuple[int, ...] = ()
    calibration: Calibration | None = None
    raw: ModelProfile | None = None

    @property
    def error(self) -> float | None:
        """The expected relative error of a predicted time (None: uncalibrated, not known)."""
        return None if self.calibration is None else self.calibration.error


def check(req: PlanRequest, mbs: Sequence[int] | None = None) -> list[int]:
    """Check the request (PipecError naming the bad option) and return the micro-batch sizes
    to profile: `mbs`, or the powers of two up to the per-replica batch; each must split the
    per-replica batch into whole micro-batches."""
    p, dp, global_batch = req.p, req.dp, req.global_batch
    if p < 1:
        raise PipecError(f"--pp must be at least 1 (got {p})")
    if global_batch < 1 or dp < 1:
        raise PipecError(f"--global-batch ({global_batch}) and --dp ({dp}) must be positive")
    if global_batch % dp:
        raise PipecError(
            f"--global-batch {global_batch} is not divisible by --dp {dp}; every data-parallel "
            f"copy needs the same batch, e.g. --global-batch {global_batch + (-global_batch) % dp}"
        )
    schedule_names(req.schedules)
    strategy_names(req.strategies)
    per_replica = global_batch // dp
    if mbs:
        bad = [s for s in mbs if s < 1 or per_replica % s]
        if bad:
            raise PipecError(
                f"--mbs {bad[0]} does not divide the per-replica batch {per_replica} "
                f"(--global-batch {global_batch} / --dp {dp}) into whole micro-batches"
            )
        return sorted(set(mbs))
    sizes = [1]
    while per_replica % (sizes[-1] * 2) == 0:
        sizes.append(sizes[-1] * 2)
    return sizes


def plan_profile(
    profile: ModelProfile,
    req: PlanRequest,
    calibration: Calibration | None = None,
    raw: ModelProfile | None = None,
) -> Plan:
    """Evaluate every candidate on `profile` (the block profile `raw` scaled by `calibration`
    when given); PipecError when none fits the budget."""
    check(req, profile.sizes)
    ev = evaluate(profile, req)
    if calibration is not None:  # each schedule that ran, corrected by its runs
        fix = calibration.corrected
        ev = replace(ev, fits=[fix(e) for e in ev.fits], over=[fix(e) for e in ev.over])
    if not ev.fits:
        if not ev.over:
            why = ev.skipped[0].reason if ev.skipped else "no candidate"
            raise PipecError(f"no candidate could be compiled: {why}")
        least = min(ev.over, key=lambda e: e.peak_bytes)
        raise PipecError(
            f"--memory-per-device {format_bytes(req.bytes_per_device)} fits no candidate; the "
            f"smallest that fits one is {format_bytes(least.peak_bytes)} "
            f"({least.peak_bytes} bytes: {least.schedule} {least.strategy} at mbs {least.mbs})"
        )
    plain_1f1b = [e for e in ev.fits if e.family == BASELINE and e.strategy == "plain"]
    baseline = max(plain_1f1b, key=lambda e: e.mbs, default=None)
    fits, places = ranked(ev.fits, None if calibration is None else calibration.error)
    ev = replace(ev, fits=fits)
    return Plan(req, profile, ev, baseline, tuple(places), calibration, raw)


def plan_model(
    spec: str,
    req: PlanRequest,
    *,
    mbs: Sequence[int] | None = None,
    time_budget: float = 60.0,
    runs: int = 3,
    peak_flops: float | None = None,
    progress: bool = True,
    device: str | None = None,
) -> Plan:
    """Profile `spec` at the micro-batch sizes the batch allows, on `device` (default: where
    its factory builds it), then plan (see plan_profile).

    The request is checked before profiling, so a typo costs no measurement.
    """
    from pipec.plan.profile_mbs import profile_model  # torch: only when profiling

    sizes = check(req, mbs)
    profile = profile_model(
        spec,
        sizes,
        time_budget=time_budget,
        runs=runs,
        peak_flops=peak_flops,
        progress=progress,
        device=device,
        p=req.p,
    )
    return plan_profile(profile, req)


def calibrate(
    plan: Plan,
    observed: Sequence[Observed],
    link: tuple[float, float] | None = None,
    conditions: Conditions | None = None,
) -> Plan:
    """`plan` (uncalibrated, its profile the block profile) priced again from the runs in
    `observed` (pipec/plan/calibration.py: `fold`), its ties marked by the error they leave."""
    raw = plan.raw or plan.profile
    req = replace(plan.request, instr_s=())
    calibration, profile, priced = fold(raw, observed, req, link, conditions)
    return plan_profile(profile, priced, calibration, raw)
