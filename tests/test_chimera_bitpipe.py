"""Chimera and BitPipe: the papers' figures, weights held twice, and the replica all-reduce."""

import importlib.util
from pathlib import Path

import pytest

from pipec.ir import COMPUTE_OPS, Instr, Op
from tests.helpers import CHUNK_UNITS, peaks, run

BENCH = Path(__file__).resolve().parent.parent / "bench"
EQUAL_FB = "F=1,B=1,W=0"  # a fused backward as long as a forward
# Default unit costs make a fused backward B+W = 2F: the B = 2F of the BitPipe figure.


@pytest.mark.parametrize("d, n", [(4, 4), (4, 8), (6, 6), (6, 12), (8, 8), (8, 16), (8, 24)])
def test_chimera_bubble_ratio_is_the_papers(d, n):
    """(D-2)/(2N+D-2): D/2-1 idle slots before and after on every rank, N a multiple of D."""
    r = run("chimera", d, n, costs=EQUAL_FB)
    assert r.sim.bubble == pytest.approx((d - 2) / (2 * n + d - 2))
    assert r.sim.span_bubble == pytest.approx((d - 2) / (2 * n + d - 2))


def _shortest_chimera(d: int, n: int, backward: int) -> int:
    """The exhaustive search of `bench/chimera_optimum.py` (loaded by path: bench is not a
    package)."""
    spec = importlib.util.spec_from_file_location("chimera_optimum", BENCH / "chimera_optimum.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.shortest(d, n, backward)


def test_chimera_with_backward_twice_the_forward():
    """The paper's formula counts a forward and a backward as one slot each. With B = 2F no
    order reaches it at D=N=4: the shortest iteration over all active schedules is 16 slots
    (bubble 0.25, not 0.2), and ours takes exactly that. With B = F the search and the
    formula agree (10 slots, 0.2)."""
    assert _shortest_chimera(4, 4, 2) == 16 == run("chimera", 4, 4).sim.makespan
    assert 1 - 4 * 3 / 16 > (4 - 2) / (2 * 4 + 4 - 2)
    assert _shortest_chimera(4, 4, 1) == 10 == run("chimera", 4, 4, costs=EQUAL_FB).sim.makespan


@pytest.mark.parametrize("d, n", [(4, 4), (8, 8), (8, 16), (6, 18)])
def test_chimera_activations_between_half_plus_one_and_d(d, n):
    assert all(d // 2 + 1 <= x <= d for x in peaks(run("chimera", d, n)))
    if n == d:  # one unit: the end ranks hold D/2+1, the middle ones D
        assert peaks(run("chimera", d, n))[0] == d // 2 + 1
        assert peaks(run("chimera", d, n))[d // 2] == d


def test_chimera_weights_twice_and_sync_at_the_end():
    r = run("chimera", 4, 8)
    assert [s.params for s in r.sim.ranks] == [2, 2, 2, 2]
    # Rank 1 holds chunk 1 (down) and chunk 2 (up): both replicated on rank 2.
    assert r.compiled.programs[1][-3:] == (
        Instr(Op.ALLREDUCE_GRADS, 1, None, 2),
        Instr(Op.ALLREDUCE_GRADS, 6, None, 2),
        Instr(Op.OPTIMIZER_STEP),
    )
    assert [s.params for s in run("1f1b", 4, 8).sim.ranks] == [1, 1, 1, 1]


def test_bitpipe_figure_d4_n4():
    """D=4, N=4, B=2F: the iteration takes 28 chunk units on every rank, 24 of them busy."""
    r = run("bitpipe", 4, 4, costs=CHUNK_UNITS)
    assert r.sim.makespan == 28
    assert [s.busy for s in r.sim.ranks] == [24, 24, 24, 24]
    assert max(s.span for s in r.sim.ranks) == 28


@pytest.mark.parametrize("p, m", [(4, 4), (4, 8), (4, 16), (6, 12), (8, 8), (8, 16), (8, 32)])
def test_bitpipe_bubble_below_interleaved_and_chimera(p, m):
    bit, inter, chim = run("bitpipe", p, m), run("interleaved", p, m, 2), run("chimera", p, m)
    assert bit.sim.bubble < inter.sim.bubble
    assert bit.sim.bubble < chim.sim.bubble


def test_bitpipe_layout_and_local_turn():
    r = run("bitpipe", 4, 8)
    layout = r.compiled.layout
    assert layout.stages_of_rank(0) == (0, 7, 11, 12)
    assert [s.params for s in r.sim.ranks] == [2, 2, 2, 2]  # four chunks of 1/2 a share
    # The V turns on rank p-1 (down: stages 3 -> 4) and rank 0 (up: 11 -> 12): no sends.
    sends = {(i.op, i.stage) for prog in r.compiled.programs for i in prog}
    assert (Op.SEND_ACT, 3) not in sends and (Op.SEND_ACT, 11) not in sends
    assert (Op.SEND_GRAD, 4) not in sends and (Op.SEND_GRAD, 12) not in sends


def test_bitpipe_syncs_eagerly():
    """Each chunk's all-reduce comes after its last backward and, on every rank, before
    compute that remains: the collective overlaps it."""
    for prog in run("bitpipe", 4, 8).compiled.programs:
        last_compute = max(k for k, i in enumerate(prog) if i.op in COMPUTE_OPS)
        syncs = [k for k, i in enumerate(prog) if i.op is Op.ALLREDUCE_GRADS]
        assert len(syncs) == 4 and min(syncs) < last_compute


def test_eager_sync_hides_the_allreduce_that_chimera_pays_at_the_end():
    """`allreduce` is one rank's share's all-reduce and a chunk's takes its part; a rank's
    collectives run one after another. Both sync the same gradients per rank (2 shares)."""
    for name, v in (("chimera", 1), ("bitpipe", 2)):
        base = run(name, 4, 8, v).sim
        slow = run(name, 4, 8, v, costs="allreduce=1").sim
        exposed = slow.makespan - base.makespan
        if name == "chimera":  # two whole shares per rank pair, both after the last backward
            assert exposed == 2 and max(s.sync for s in slow.ranks) == 2
        else:  # four half shares per pair, most issued while compute remains
            assert exposed < 2 and max(s.sync for s in slow.ranks) < 2
            per_chunk = run(name, 4, 8, v, costs="per=chunk,F=0.5,B=0.5,W=0.5,allreduce=0.5").sim
            assert per_chunk.makespan == slow.makespan


@pytest.mark.parametrize("p, m", [(4, 16), (6, 12), (8, 32)])
def test_bitpipe_warmup_and_memory(p, m):
    """Rank r runs 2p + min(r, p-1-r) chunk forwards before its first backward (the paper's
    order: p/2 fewer) and peaks below interleaved 1F1B's activations at equal p, m."""
    orders = run("bitpipe", p, m).compiled.programs
    warm = [
        sum(i.op is Op.F for i in prog[: prog.index(next(i for i in prog if i.op is Op.BW))])
        for prog in orders
    ]
    assert warm == [2 * p + min(r, p - 1 - r) for r in range(p)]
    assert max(peaks(run("bitpipe", p, m))) < max(peaks(run("interleaved", p, m, 2)))
