"""Small helpers shared by the schedule tests."""

from passes.costs import CostModel, parse_costs
from pipec.compile import CompileResult, compile_schedule


def run(
    schedule: str, p: int, m: int, v: int | None = None, costs: str = "", **kw
) -> CompileResult:
    """Compile (build, lower, simulate, verify) with costs given as the CLI's string."""
    return compile_schedule(schedule, p, m, v, parse_costs(costs) if costs else CostModel(), **kw)


def peaks(result: CompileResult) -> list[float]:
    return [r.peak_activations for r in result.sim.ranks]
