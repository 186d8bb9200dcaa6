"""Costs as a run executes them: the block profile scaled by what real runs measured.

The block profile times each op alone, in one process, with nothing else running: it gives
the relative costs of blocks and micro-batch sizes. A run executes the same ops with one
rank per process, ranks at once on the machine, B and W apart, messages in flight, and its
interpreter spends time on every instruction. So a plan is calibrated from runs (a short
calibration run of `pipec plan`, pipec/plan/calibrate_run.py, or a finished `pipec run`,
`--calibrate BUILD`): for each op kind and micro-batch size, the factor is the sum over the
stages of the run's median durations over the sum of the profile's prices for the same
chunks. Every candidate is then priced from the profile scaled by these factors, plus the
runtime's own time per instruction and the message link the calibration run measured.

Where a size was not run, a kind takes its factor at the nearest size that was; a kind no
run executed takes a related one's (`FALLBACK`: B and W apart from BW, and back). RECOMPUTE
is a forward and counts as F. The optimizer step's factor and the cost per instruction come
from runs without all-reduces where there are some (a step after them waits for them, which
the simulator times apart).

What the model still misses depends on the schedule (how its ops contend for the cores, its
all-reduces, its interpreter's share): each schedule and strategy that ran is corrected at
each size it ran by its run's measured / predicted, so that a candidate that ran is priced from
its own run, one of the same schedule at another size by the nearest size's correction; a
schedule that did not run takes the median correction of those that did (the model's usual
miss). A run's time is the median of its turns' medians.

The expected error is the larger of how well a correction carries to another size (for a
schedule run at several sizes, the largest |prediction corrected as if its size had not run /
measured - 1|: the model's error across sizes and the runs' noise) and how far a run's median
may be from another run's of the same build (`spread`: chance and the machine's drift between
turns, the median over the runs), and never below `MIN_ERROR`. Candidates predicted within it
of each other are ties (pipec/plan/ranking.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipec.ir import Compiled, Op, op_kinds
from pipec.passes.registry import Request
from pipec.passes.simulate import simulate
from pipec.passes.topology import Link, Topology
from pipec.plan.candidates import (
    RECOMPUTE_SUFFIX,
    Evaluated,
    PlanRequest,
    at_size,
    is_recompute_variant,
    iteration_time,
    price,
)
from pipec.plan.conditions import Conditions
from pipec.plan.facts import FBW, ModelProfile

#: The op kinds a factor is kept for, and the op each of a run's instructions counts as.
KINDS = ("F", "B", "W", "BW")
KIND_OF = {Op.F: "F", Op.RECOMPUTE: "F", Op.B: "B", Op.W: "W", Op.BW: "BW"}
#: The kind whose factor stands in for one no run executed.
FALLBACK = {"B": "BW", "W": "BW", "BW": "B"}
MIN_ERROR = 0.02
"""The smallest expected error a plan states: a difference of 2% is not a ranking."""


@dataclass(frozen=True)
class Observed:
    """One run of a build: per op kind, the sum over stages of its median durations and of the
    profile's prices for the same chunks (seconds); the same for the optimizer steps (summed
    over ranks); the runtime's own seconds per instruction (median over ranks); each kept
    step's iteration time; and the programs it ran, to predict it again once calibrated."""

    source: str
    family: str  # the schedule and strategy, as `key` names a candidate's
    mbs: int
    kinds: tuple[tuple[str, float, float], ...]
    optimizer: tuple[float, float]
    instr_s: float
    iterations: tuple[float, ...]
    precision: str
    compiled: Compiled = field(repr=False, compare=False)
    turns: tuple[float, ...] = ()
    """Each turn's median iteration time, where the run came in turns (a calibration run)."""


@dataclass(frozen=True)
class Calibration:
    """Factors (measured / profiled) per micro-batch size and op kind, the optimizer step's
    factor, the runtime's seconds per instruction by micro-batch size (its sends grow with
    it), the link measured between ranks (latency s, bytes per s; None: not measured), and how
    well the result predicts the runs it came from: each run's (source, predicted s, measured
    s), the spread, the expected error."""

    factors: tuple[tuple[int, str, float], ...]
    optimizer: float
    instr_s: tuple[tuple[int, float], ...]
    link: tuple[float, float] | None
    conditions: Conditions | None
    runs: tuple[tuple[str, str, int, float, float], ...] = ()
    """Per run: its source, its schedule and strategy, its micro-batch size, the model's
    prediction and the measured iteration time (seconds)."""
    spread: float = 0.0
    error: float = MIN_ERROR

    @property
    def corrections(self) -> dict[tuple[str, int], float]:
        """Per schedule and strategy and micro-batch size that ran: measured / predicted (the
        median over its runs there)."""
        found: dict[tuple[str, int], list[float]] = {}
        for _, family, mbs, predicted, measured in self.runs:
            found.setdefault((family, mbs), []).append(measured / predicted)
        return {k: statistics.median(v) for k, v in found.items()}

    def correction(self, family: str, mbs: int, leave_out: int | None = None) -> float:
        """The factor a candidate of `family` (`key`) at `mbs` is priced with: its runs' there,
        else at the nearest size its schedule ran, else the median over everything that ran
        (the model's usual miss), else 1. `leave_out`: as if that size had not run."""
        found = {k: c for k, c in self.corrections.items() if k[1] != leave_out}
        own = [(n, c) for (f, n), c in found.items() if f == family]
        if own:
            return at_size(own, mbs)
        return statistics.median(found.values()) if found else 1.0

    def corrected(self, ev: Evaluated) -> Evaluated:
        """`ev` with its predicted iteration time corrected by its schedule's runs."""
        return replace(ev, iteration_s=ev.iteration_s * self.correction(key(ev), ev.mbs))

    def factor(self, mbs: int, kind: str) -> float:
        """The factor of `kind` at `mbs`: measured there, else at the nearest size measured
        (the smaller on a tie), else `FALLBACK`'s kind's, else 1."""
        for k in (kind, FALLBACK.get(kind)):
            found = [(n, f) for n, kd, f in self.factors if kd == k]
            if found:
                return at_size(found, mbs)
        return 1.0

    def apply(self, profile: ModelProfile) -> ModelProfile:
        """`profile` with every op's seconds scaled by its kind's factor at its size."""

        def scaled(pt):  # type: ignore[no-untyped-def]
            f = {k: self.factor(pt.mbs, k) for k in KINDS}
            seconds = tuple(FBW(s.F * f["F"], s.B * f["B"], s.W * f["W"]) for s in pt.seconds)
            fused = tuple(x * f["BW"] for x in pt.fused_backward)
            return replace(pt, seconds=seconds, fused_backward=fused)

        blocks = tuple(
            replace(b, optimizer_s=b.optimizer_s * self.optimizer) for b in profile.blocks
        )
        return replace(profile, blocks=blocks, points=tuple(map(scaled, profile.points)))

    def priced(self, req: PlanRequest) -> PlanRequest:
        """`req` with the runtime's cost per instruction and, unless `--comm` or `--link` gave
        the transfers' price, the link measured between the ranks."""
        req = replace(req, instr_s=self.instr_s)
        if self.link is None or req.comm_s or req.machine is not None:
            return req
        latency, bandwidth = self.link
        link = Link(bandwidth, latency)
        return replace(req, machine=Topology(1, req.p, link, link))

    @property
    def residual(self) -> float:
        """The largest |corrected / measured - 1| over the runs of schedules that ran at more
        than one size, each corrected as if its own size had not run: how well a correction
        carries to another size."""
        sizes: dict[str, set[int]] = {}
        for _, f, n, _, _ in self.runs:
            sizes.setdefault(f, set()).add(n)
        return max(
            (
                abs(p * self.correction(f, n, leave_out=n) / m - 1)
                for _, f, n, p, m in self.runs
                if len(sizes[f]) > 1
            ),
            default=0.0,
        )

    @property
    def model_miss(self) -> float:
        """The largest |predicted / measured - 1| over the runs, by the model alone."""
        return max((abs(p / m - 1) for *_, p, m in self.runs), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "factors": [list(f) for f in self.factors],
            "optimizer": self.optimizer,
            "instr_s": [list(x) for x in self.instr_s],
            "link": None if self.link is None else list(self.link),
            "conditions": None if self.conditions is None else self.conditions.to_json(),
            "runs": [list(r) for r in self.runs],
            "corrections": [[f, n, c] for (f, n), c in sorted(self.corrections.items())],
            "spread": self.spread,
            "error": self.error,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Calibration:
        return Calibration(
            tuple((int(n), str(k), float(f)) for n, k, f in d["factors"]),
            d["optimizer"],
            tuple((int(n), float(x)) for n, x in d["instr_s"]),
            None if d["link"] is None else (d["link"][0], d["link"][1]),
            None if d["conditions"] is None else Conditions.from_json(d["conditions"]),
            tuple((str(s), str(f), int(n), float(p), float(m)) for s, f, n, p, m in d["runs"]),
            d["spread"],
            d["error"],
        )


def _ratio(pairs: Sequence[tuple[float, float]]) -> float | None:
    measured, profiled = sum(m for m, _ in pairs), sum(p for _, p in pairs)
    return measured / profiled if profiled > 0 and measured > 0 else None


def spread(iterations: Sequence[float], turns: Sequence[float] = ()) -> float:
    """How far the median of one run's step times may be from another run's of the same
    build, over it: the larger of the standard error of a median of n samples, 1.2533 sigma /
    sqrt(n) with sigma estimated from the interquartile range (IQR / 1.349, so that a step
    hit by a burst of load counts little), and half the range of its turns' medians (how far
    the machine drifted between them). 0 for under 2 steps."""
    if len(iterations) < 2:
        return 0.0
    q1, q2, q3 = statistics.quantiles(iterations, n=4, method="inclusive")
    sigma = (q3 - q1) / 1.349
    drift = (max(turns) - min(turns)) / 2 if turns else 0.0
    return max(1.2533 * sigma / math.sqrt(len(iterations)), drift) / q2 if q2 > 0 else 0.0


def predict(profile: ModelProfile, req: PlanRequest, o: Observed) -> float:
    """The iteration time of the programs `o` ran, priced from `profile` as a plan prices a
    candidate of its schedule at `o`'s micro-batch size."""
    c = o.compiled
    name = (
        c.schedule.removesuffix(RECOMPUTE_SUFFIX)
        if is_recompute_variant(c.schedule)
        else c.schedule
    )
    instr_s = at_size(req.instr_s, o.mbs)
    _, chunks, costs = price(
        profile,
        name,
        Request(c.p, c.m, c.v),
        o.mbs,
        req.comm_s,
        req.machine,
        req.precision,
        instr_s,
    )
    return iteration_time(simulate(c.layout, c.programs, costs), c.layout, chunks)


def fold(
    raw: ModelProfile,
    observed: Sequence[Observed],
    req: PlanRequest,
    link: tuple[float, float] | None = None,
    conditions: Conditions | None = None,
) -> tuple[Calibration, ModelProfile, PlanRequest]:
    """The calibration the runs in `observed` give the block profile `raw`, the profile it
    prices with, and `req` priced with its per-instruction cost and link (see the module
    docstring). The runs are then predicted again to state the expected error."""
    pairs: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for o in observed:
        for kind, took, priced_s in o.kinds:
            pairs.setdefault((o.mbs, kind), []).append((took, priced_s))
    factors = tuple(
        (mbs, kind, f) for (mbs, kind), ps in sorted(pairs.items()) if (f := _ratio(ps)) is not None
    )
    # A step after all-reduces waits for them, which the simulator times apart; their
    # gradients' packing is apart from the interpreter's cost too, but not exactly.
    alone = [o for o in observed if Op.ALLREDUCE_GRADS not in op_kinds(o.compiled.programs)]
    optimizer = _ratio([o.optimizer for o in alone or observed]) or 1.0
    sizes = sorted({o.mbs for o in observed})
    instr_s = tuple(
        (n, statistics.median(o.instr_s for o in (alone or observed) if o.mbs == n))
        for n in sizes
        if any(o.mbs == n for o in alone or observed)
    )
    cal = Calibration(factors, optimizer, instr_s, link, conditions)
    profile, priced = cal.apply(raw), cal.priced(req)
    runs = tuple(
        (o.source, o.family, o.mbs, predict(profile, priced, o), run_time(o)) for o in observed
    )
    noise = statistics.median(spread(o.iterations, o.turns) for o in observed)
    cal = replace(cal, runs=runs, spread=noise)
    return replace(cal, error=max(MIN_ERROR, cal.residual, cal.spread)), profile, priced


def run_time(o: Observed) -> float:
    """A run's iteration time: the median of its turns' medians (a turn that a burst of load
    hit counts as one of four), else of its steps."""
    return statistics.median(o.turns or o.iterations)


def key(ev: Evaluated) -> str:
    """How a calibration names a candidate's schedule and strategy."""
    return f"{ev.schedule} {ev.strategy}"
