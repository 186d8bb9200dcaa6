"""The work graph (networkx) has the edges the passes read from `dependency_table`: every
compiled schedule runs its ops in one of the graph's topological orders."""

import networkx as nx
import pytest

from pipec.ir import COMPUTE_OPS, Op, op_kinds, work_graph
from pipec.passes.simulate import play
from tests.helpers import run


@pytest.mark.parametrize(
    "name, p, m, v",
    [
        ("1f1b", 4, 8, None),
        ("1f1b-r", 4, 8, None),
        ("zb-h1", 4, 8, None),
        ("interleaved", 4, 8, 2),
        ("v-half", 4, 8, None),
        ("gpipe", 3, 5, None),
    ],
)
def test_every_schedule_runs_its_ops_in_a_topological_order_of_the_work_graph(name, p, m, v):
    result = run(name, p, m, v)
    c = result.compiled
    kinds = op_kinds(c.programs)
    g = work_graph(c.layout, split_bw=Op.B in kinds, recompute=Op.RECOMPUTE in kinds)
    assert nx.is_directed_acyclic_graph(g)
    ops = [(i.op, i.stage, i.mb) for prog in c.programs for i in prog if i.op in COMPUTE_OPS]
    assert sorted(g.nodes, key=str) == sorted(ops, key=str)  # each op once, no other node
    sources = {n for n in g if g.in_degree(n) == 0}  # only a pipeline's first forwards
    assert sources == {(Op.F, pl.stages[0], i) for pl in c.layout.pipelines for i in pl.mbs}
    times, done, _ = play(c.layout, c.programs, result.costs)
    place = {node: k for k, node in enumerate(done)}
    for a, b in g.edges:
        assert place[a] < place[b] and times[a][1] <= times[b][0], (a, b)
