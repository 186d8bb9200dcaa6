"""Simulated bubble of BitPipe vs interleaved 1F1B (v=2) vs Chimera at equal p and m.

Costs are per chunk op; by default F = B = W = 1, so a fused backward takes 2F (the papers'
B = 2F). Interleaved and BitPipe run chunks of half a rank's share, Chimera full shares; the
bubble ratio 1 - busy / (p · makespan) does not depend on that scale. Pass --costs to change
them (the CLI's syntax, e.g. F=1,B=1,W=0 for a backward as long as a forward).

Run from the repository root: PYTHONPATH=$PWD python bench/bidirectional.py [--costs ...]
"""

import argparse

from passes.costs import parse_costs
from pipec.compile import compile_schedule

SHAPES = [(4, 4), (4, 8), (4, 16), (6, 12), (8, 8), (8, 16), (8, 32), (16, 32), (16, 64)]
FAMILIES = [("bitpipe", 2), ("interleaved", 2), ("chimera", 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", default="", help="per-op costs, e.g. F=1,B=1,W=1")
    costs = parse_costs(parser.parse_args().costs)
    print(f"{'p':>3} {'m':>4}  " + "  ".join(f"{name:>11}" for name, _ in FAMILIES))
    for p, m in SHAPES:
        bubbles = [compile_schedule(name, p, m, v, costs).sim.bubble for name, v in FAMILIES]
        print(f"{p:>3} {m:>4}  " + "  ".join(f"{b:>11.4f}" for b in bubbles))


if __name__ == "__main__":
    main()
