"""The shortest Chimera iteration at D ranks, N micro-batches, by exhaustive search.

Branch and bound over active schedules (Giffler-Thompson: the ready op that could finish
first fixes a rank, and every ready op of that rank that could start before then is a
branch), with lower bounds from each rank's remaining work and each op's longest path to
the end. Forward 1 slot, fused backward `--backward` slots. It shows why Chimera's bubble
ratio (D-2)/(2N+D-2) is a claim about equal forward and backward slots: at D=N=4 the
best iteration is 10 slots with B=F (ratio 0.2) but 16 with B=2F (0.25, not 0.2).

Run from the repository root: PYTHONPATH=$PWD python bench/chimera_optimum.py [D N B]
(D=N=4 takes seconds; larger shapes grow quickly.)
"""

import sys
from functools import cache

from pipec.ir import Op, dependencies
from pipec.passes.schedules.bidirectional import two_way_layout
from pipec.passes.schedules.slots import fused_nodes


def shortest(d: int, n: int, backward: int) -> int:
    layout = two_way_layout(d, n, tuple(range(d)))
    nodes = fused_nodes(layout)
    deps = {x: list(dependencies(layout, x)) for x in nodes}
    rank = {x: layout.stage_rank[x[1]] for x in nodes}
    dur = {x: 1 if x[0] is Op.F else backward for x in nodes}
    successors: dict = {x: [y for y in nodes if x in deps[y]] for x in nodes}

    @cache
    def tail(x: tuple) -> int:
        """The longest path from the start of x to the end of the iteration."""
        return dur[x] + max((tail(y) for y in successors[x]), default=0)

    best = [sum(dur.values())]  # any schedule is shorter than running everything in turn

    def search(end: dict, free: list[int], left: list[int]) -> None:
        if len(end) == len(nodes):
            best[0] = min(best[0], max(free))
            return
        ready = [
            (max([free[rank[x]]] + [end[y] for y in deps[x]]), x)
            for x in nodes
            if x not in end and all(y in end for y in deps[x])
        ]
        if max(f + w for f, w in zip(free, left)) >= best[0]:
            return
        if max(start + tail(x) for start, x in ready) >= best[0]:
            return
        first_end, r = min((start + dur[x], rank[x]) for start, x in ready)
        for start, x in ready:
            if rank[x] == r and start < first_end:
                end[x], before = start + dur[x], free[r]
                free[r], left[r] = end[x], left[r] - dur[x]
                search(end, free, left)
                free[r], left[r] = before, left[r] + dur[x]
                del end[x]

    search({}, [0] * d, [n * (1 + backward)] * d)
    return best[0]


if __name__ == "__main__":
    d, n, b = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (4, 4, 2)
    slots = shortest(d, n, b)
    print(
        f"D={d} N={n} B={b}F: shortest iteration {slots} slots, "
        f"bubble {1 - n * (1 + b) / slots:.4f}, "
        f"paper's (D-2)/(2N+D-2) = {(d - 2) / (2 * n + d - 2):.4f}"
    )
