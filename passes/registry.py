"""Schedule families, registered by name: each is a function from a `Request` to a `Schedule`.

Adding a schedule means writing one function, decorating it with `@schedule(...)`, and adding
its golden files. The registry also holds each family's rules on its parameters, so that bad
input is refused with one line before any work is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pipec.ir import PipecError, Schedule
from pipec.passes.costs import CostModel


@dataclass(frozen=True)
class Request:
    """What the user asked for: pipeline ranks p, micro-batches m, chunks per rank v, and the
    costs (a family sees them per chunk op: `build_schedule`)."""

    p: int
    m: int
    v: int
    costs: CostModel = CostModel()  # noqa: RUF009 - frozen: one shared default is safe
    memory_limit: float | None = None


@dataclass(frozen=True)
class Family:
    """A registered schedule family and the rules on its parameters."""

    name: str
    build: Callable[[Request], Schedule]
    summary: str
    default_v: int
    chunks: str
    """Human-readable rule on v, e.g. '1' or '>= 2'."""
    checks: tuple[Callable[[Request], str | None], ...]
    """Each returns why the request is not allowed for this family, or None."""


def only_v(*allowed: int) -> Callable[[Request], str | None]:
    """A check that allows only the given chunk counts."""

    def check(req: Request) -> str | None:
        if req.v not in allowed:
            return f"--chunks {req.v} is not allowed; it takes {' or '.join(map(str, allowed))}"
        return None

    return check


SCHEDULES: dict[str, Family] = {}


def schedule(
    name: str,
    summary: str,
    *,
    default_v: int = 1,
    chunks: str = "1",
    checks: tuple[Callable[[Request], str | None], ...] = (only_v(1),),
) -> Callable[[Callable[[Request], Schedule]], Callable[[Request], Schedule]]:
    """Register a schedule family under `name`."""

    def register(fn: Callable[[Request], Schedule]) -> Callable[[Request], Schedule]:
        assert name not in SCHEDULES, f"schedule {name} registered twice"
        SCHEDULES[name] = Family(name, fn, summary, default_v, chunks, checks)
        return fn

    return register


def family(name: str) -> Family:
    """The family registered as `name`, or a PipecError listing the valid names."""
    import pipec.passes.schedules  # noqa: F401  (registers the built-in families)

    if name not in SCHEDULES:
        raise PipecError(
            f"unknown schedule '{name}'; valid schedules: {', '.join(sorted(SCHEDULES))}"
        )
    return SCHEDULES[name]


def build_schedule(name: str, req: Request) -> Schedule:
    """Validate the request against the family's rules, then build the schedule. The family
    sees costs per chunk op: every family lays out p·v model chunks (two replicas of them in
    Chimera and DualPipe), so a chunk is 1/v of a rank's share (its `Layout.stash_share`)."""
    fam = family(name)
    if req.p < 1:
        raise PipecError(f"--pp must be at least 1 (got {req.p})")
    if req.m < 1:
        raise PipecError(f"--microbatches must be at least 1 (got {req.m})")
    if req.v < 1:
        raise PipecError(f"--chunks must be at least 1 (got {req.v})")
    for check in fam.checks:
        why = check(req)
        if why:
            raise PipecError(f"{name}: {why}")
    sched = fam.build(replace(req, costs=req.costs.of_chunks(1 / req.v)))
    assert sched.layout.stash_share == 1 / req.v, f"{name}: a chunk is not 1/v of a share"
    return sched
