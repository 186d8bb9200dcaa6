"""torch.distributed.pipelining's schedules, imported and simulated by pipec, beside pipec's own.

    python bench/torch_orders.py

Prints one markdown row per (torch class, p, m, costs): the simulated makespan, wall-time and
span bubbles and peak stashes of torch's order, and the makespan of the pipec family that
builds the same schedule when it is registered (and whether the per-rank orders are identical).
"""

from __future__ import annotations

from pipec.compile import CompileResult, compile_schedule
from pipec.interop import compile_torch_class
from pipec.ir import COMPUTE_OPS
from pipec.passes.costs import CostModel, parse_costs
from pipec.passes.registry import SCHEDULES, family

COSTS = {
    "unit": CostModel(per="chunk"),
    "1.5B": parse_costs("per=chunk,F=18.522,B=18.086,W=9.337,comm=0.601"),
}
"""Per chunk op, as the peers' reference figures (bench/data/README.md): a two-chunk order's
op takes the cost as given, not half of it."""
#: torch class, its stages per rank, and the pipec family that builds the same schedule.
PAIRS = [
    ("ScheduleGPipe", 1, "gpipe"),
    ("Schedule1F1B", 1, "1f1b"),
    ("ScheduleInterleaved1F1B", 2, "interleaved"),
    ("ScheduleLoopedBFS", 2, None),
    ("ScheduleInterleavedZeroBubble", 1, "zb-h1"),
    ("ScheduleInterleavedZeroBubble", 2, None),
    ("ScheduleZBVZeroBubble", 2, "zb-v"),
    ("ScheduleDualPipeV", 2, "dualpipev"),
]
SHAPES = [(4, 8), (8, 24)]


def orders(result: CompileResult) -> tuple:
    return tuple(tuple(i for i in p if i.op in COMPUTE_OPS) for p in result.compiled.programs)


def main() -> None:
    family("1f1b")  # registers the built-in families
    print(
        "| torch class | v | p | m | costs | makespan | bubble | span bubble | peak "
        "| pipec family | pipec makespan | same order |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p, m in SHAPES:
        for cls, v, name in PAIRS:
            for label, costs in COSTS.items():
                t, _ = compile_torch_class(cls, p, m, v, costs)
                peak = max(r.peak_activations for r in t.sim.ranks)
                row = f"| {cls} | {v} | {p} | {m} | {label} | {t.sim.makespan:.6g} | "
                row += f"{t.sim.bubble:.4f} | {t.sim.span_bubble:.4f} | {peak:g} | "
                if name in SCHEDULES:
                    q = compile_schedule(name, p, m, None, costs)
                    row += f"{name} | {q.sim.makespan:.6g} | {orders(q) == orders(t)} |"
                else:
                    row += f"{name or '-'} | {'not registered' if name else '-'} | |"
                print(row)


if __name__ == "__main__":
    main()
