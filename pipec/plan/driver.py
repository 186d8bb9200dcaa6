"""The plan driver: check the batch arithmetic, profile, evaluate, pick the baseline.

`plan_model` profiles a model factory and plans; `plan_profile` plans from a profile that is
already at hand (tests inject synthetic MFU curves through it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipec.ir import PipecError
from pipec.plan.candidates import (
    BASELINE,
    Evaluated,
    Evaluation,
    evaluate,
    schedule_names,
    strategy_names,
)
from pipec.plan.facts import ModelProfile
from pipec.plan.memory import format_bytes


@dataclass(frozen=True)
class Plan:
    """A finished plan: the inputs, the profile, every candidate, and the 1F1B baseline (plain
    1F1B at the largest micro-batch size that fits; None when none does)."""

    profile: ModelProfile
    p: int
    dp: int
    global_batch: int
    bytes_per_device: int
    evaluation: Evaluation
    baseline: Evaluated | None


def mbs_sizes(p: int, global_batch: int, dp: int, requested: Sequence[int] | None) -> list[int]:
    """Micro-batch sizes to profile: the requested ones, or the powers of two up to the
    per-replica batch; each must split the per-replica batch into whole micro-batches.
    Checks the shape of the request first (PipecError naming the bad option)."""
    if p < 1:
        raise PipecError(f"--pp must be at least 1 (got {p})")
    if global_batch < 1 or dp < 1:
        raise PipecError(f"--global-batch ({global_batch}) and --dp ({dp}) must be positive")
    if global_batch % dp:
        raise PipecError(
            f"--global-batch {global_batch} is not divisible by --dp {dp}; every data-parallel "
            f"copy needs the same batch, e.g. --global-batch {global_batch + (-global_batch) % dp}"
        )
    per_replica = global_batch // dp
    if requested:
        bad = [s for s in requested if s < 1 or per_replica % s]
        if bad:
            raise PipecError(
                f"--mbs {bad[0]} does not divide the per-replica batch {per_replica} "
                f"(--global-batch {global_batch} / --dp {dp}) into whole micro-batches"
            )
        return sorted(set(requested))
    sizes = [1]
    while per_replica % (sizes[-1] * 2) == 0:
        sizes.append(sizes[-1] * 2)
    return sizes


def plan_profile(
    profile: ModelProfile,
    *,
    p: int,
    dp: int = 1,
    global_batch: int,
    bytes_per_device: int,
    schedules: Sequence[str] | None = None,
    strategies: Sequence[str] | None = None,
    comm_s: float = 0.0,
) -> Plan:
    """Evaluate every candidate on `profile`; PipecError when none fits the budget."""
    mbs_sizes(p, global_batch, dp, profile.sizes)
    ev = evaluate(
        profile,
        p=p,
        dp=dp,
        global_batch=global_batch,
        bytes_per_device=bytes_per_device,
        schedules=schedule_names(schedules),
        strategies=strategy_names(strategies),
        comm_s=comm_s,
    )
    if not ev.fits:
        if not ev.over:
            why = ev.skipped[0].reason if ev.skipped else "no candidate"
            raise PipecError(f"no candidate could be compiled: {why}")
        least = min(ev.over, key=lambda e: e.peak_bytes)
        raise PipecError(
            f"--memory-per-device {format_bytes(bytes_per_device)} fits no candidate; the "
            f"smallest that fits one is {format_bytes(least.peak_bytes)} "
            f"({least.peak_bytes} bytes: {least.schedule} {least.strategy} at mbs {least.mbs})"
        )
    plain_1f1b = [e for e in ev.fits if e.family == BASELINE and e.strategy == "plain"]
    baseline = max(plain_1f1b, key=lambda e: e.mbs, default=None)
    return Plan(profile, p, dp, global_batch, bytes_per_device, ev, baseline)


def plan_model(
    spec: str,
    *,
    p: int,
    dp: int = 1,
    global_batch: int,
    bytes_per_device: int,
    schedules: Sequence[str] | None = None,
    strategies: Sequence[str] | None = None,
    comm_s: float = 0.0,
    mbs: Sequence[int] | None = None,
    time_budget: float = 60.0,
    runs: int = 3,
    peak_flops: float | None = None,
    progress: bool = True,
) -> Plan:
    """Profile `spec` at the micro-batch sizes the batch allows, then plan (see plan_profile).

    Every argument is checked before profiling, so a typo costs no measurement.
    """
    from pipec.plan.profile_mbs import profile_model  # torch: only when profiling

    sizes = mbs_sizes(p, global_batch, dp, mbs)
    schedules, strategies = schedule_names(schedules), strategy_names(strategies)
    profile = profile_model(
        spec, sizes, time_budget=time_budget, runs=runs, peak_flops=peak_flops, progress=progress
    )
    return plan_profile(
        profile, p=p, dp=dp, global_batch=global_batch, bytes_per_device=bytes_per_device,
        schedules=schedules, strategies=strategies, comm_s=comm_s,
    )
