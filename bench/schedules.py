"""Schedule figures beside the papers' formulas: bubble, peak memory and compile time.

For p in {4, 8, 16, 32} and m in {2p, 4p, 8p}, unit costs per chunk op (F = B = W = 1 for
one pass of one chunk, the papers' unit; a fused BW takes 2), each schedule is compiled
(build, lower, simulate, verify) and printed with: span_bubble (1 - max busy / max span, the
zero-bubble papers' metric, which the formulas give), bubble (1 - sum busy / (p · makespan),
wall time), peak activations (stashes of one rank's share of the model) and the wall-clock
compile time. The machine is shared: the load average is printed before and after. A formula
column shows "-" where no paper gives one.

To add a family, append its name to SCHEDULES and, if a paper gives its figures, a Formula to
FORMULAS; nothing else changes. Chimera's formula holds with a backward as long as a forward
(`--costs`-free here, so B = 2F: its column is the paper's claim, not what these costs allow).

Run from the repository root:
    PYTHONPATH=$PWD python bench/schedules.py [--pp 4,8] [--schedules 1f1b,v-min]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipec.compile import compile_schedule
from pipec.ir import PipecError
from pipec.passes.costs import CostModel
from pipec.passes.registry import family

SCHEDULES = [
    "1f1b",
    "interleaved",
    "zb-h1",
    "zb-h2",
    "zb-auto",
    "zb-v",
    "v-min",
    "v-half",
    "v-zb",
    "v-adaptive",
    "chimera",
    "bitpipe",
    "dualpipe",
    "dualpipev",
]
PP = (4, 8, 16, 32)
M_PER_P = (2, 4, 8)
CHUNK_UNITS = CostModel(per="chunk")
"""F = B = W = 1 per chunk op: the unit the formulas below count in (ratios and peaks do not
depend on it, but absolute times would)."""


@dataclass(frozen=True)
class Formula:
    """A paper's span bubble and per-rank peak (stashes) at unit costs, as functions of (p, m)."""

    bubble: Callable[[int, int], float]
    peak: Callable[[int, int], float]
    source: str


def _idle_over(units: Callable[[int], int], work: int) -> Callable[[int, int], float]:
    """Span bubble when a rank idles units(p) within its span and works work·m."""
    return lambda p, m: units(p) / (work * m + units(p))


def _v_min_units(p: int) -> int:
    return 4 * p - 7 if p % 3 == 0 else 4 * p - 5


def _v_half_units(p: int) -> int:
    return 3 * p - 7 if p % 2 == 0 else 3 * p - 4


ZERO = Formula(lambda p, m: 0.0, lambda p, m: p, "zero bubble at p stashes")
FORMULAS: dict[str, Formula] = {
    "1f1b": Formula(lambda p, m: (p - 1) / (m + p - 1), lambda p, m: p, "(p-1)/(m+p-1)"),
    "interleaved": Formula(
        lambda p, m: (p - 1) / (2 * m + p - 1), lambda p, m: (3 * p - 1) / 2, "v=2: (p-1)/(vm+p-1)"
    ),
    "zb-h1": Formula(_idle_over(lambda p: p - 1, 3), lambda p, m: p, "(p-1)(F+B-W)"),
    "zb-h2": Formula(lambda p, m: 0.0, lambda p, m: 2 * p - 1, "(p-1)(F+B-2W) = 0 at 2p-1"),
    "zb-auto": Formula(_idle_over(lambda p: p - 1, 3), lambda p, m: p, "ZB-1P <= ZB-H1"),
    "zb-v": ZERO,
    "v-min": Formula(
        _idle_over(_v_min_units, 6), lambda p, m: (p + 4) // 3, "4p-5 (4p-7), (p+4)//3"
    ),
    "v-half": Formula(
        _idle_over(_v_half_units, 6), lambda p, m: (p + 2) // 2, "3p-7 (3p-4), (p+2)//2"
    ),
    "v-zb": ZERO,
    "v-adaptive": ZERO,
    "chimera": Formula(
        lambda p, m: (p - 2) / (2 * m + p - 2), lambda p, m: p, "(D-2)/(2N+D-2) if B=F"
    ),
    # DeepSeek counts an F&B pair as one unit that waits for both inputs; pipec simulates the
    # pair in turn, as its runtime runs it (each op on its own input), so it idles no more.
    "dualpipe": Formula(
        _idle_over(lambda p: p - 2, 3), lambda p, m: p + 1, "(PP/2-1)(F&B+B-3W) at most, PP+1"
    ),
    "dualpipev": Formula(
        _idle_over(lambda p: 2 * p - 2, 6), lambda p, m: p + 0.5, "PP=2p at most, (PP+1)/2 sh."
    ),
}


def row(name: str, p: int, m: int) -> str:
    v = family(name).default_v
    start = time.perf_counter()
    try:
        result = compile_schedule(name, p, m, v, CHUNK_UNITS)
    except PipecError as e:
        return f"{name:<12}{p:>4}{m:>5}  refused: {e}"
    ms = (time.perf_counter() - start) * 1000
    sim = result.sim
    peak = max(r.peak_activations for r in sim.ranks)
    f = FORMULAS.get(name)
    paper = f"{f.bubble(p, m):>9.4f}{f.peak(p, m):>7g}  {f.source}" if f else f"{'-':>9}{'-':>7}"
    return (
        f"{name:<12}{p:>4}{m:>5}{sim.span_bubble:>9.4f}{sim.bubble:>9.4f}{peak:>7g}"
        f"{ms:>10.0f}  |{paper}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default=",".join(map(str, PP)), help="pipeline sizes, e.g. 4,8")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="families to run")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{'schedule':<12}{'p':>4}{'m':>5}{'span_bub':>9}{'bubble':>9}{'peak':>7}{'compile':>10}"
        f"  |{'paper':>9}{'peak':>7}  formula"
    )
    for p in map(int, args.pp.split(",")):
        for m in (k * p for k in M_PER_P):
            for name in args.schedules.split(","):
                print(row(name, p, m), flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
