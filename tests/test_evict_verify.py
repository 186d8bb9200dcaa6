"""Stash moves in the verifier and the simulator: each invariant catches a broken program."""

from dataclasses import replace

import pytest

from pipec.ir import Compiled, Instr, Layout, Op, Pipeline
from pipec.passes.costs import CostModel
from pipec.passes.evict import insert_evictions
from pipec.passes.residency import check_residency
from pipec.passes.simulate import simulate
from pipec.passes.topology import make_topology
from pipec.passes.verify import VerifyError, verify
from tests.test_evict import lowered

EVICT, LOAD, ACCEPT, RETURN = Op.EVICT, Op.LOAD, Op.ACCEPT, Op.RETURN


@pytest.fixture
def evicted() -> Compiled:
    """1F1B p=4 m=8 held to 3: rank 0 evicts mb 2 and 5 to rank 3 and loads them back."""
    return insert_evictions(lowered("1f1b", 4, 8), CostModel(), 3)


def edit(compiled: Compiled, **programs: list) -> Compiled:
    new = list(compiled.programs)
    for name, prog in programs.items():
        new[int(name[1:])] = tuple(prog)
    return replace(compiled, programs=tuple(new))


def without(prog, *instrs):
    return [i for i in prog if i not in instrs]


def test_the_evicted_program_verifies_and_counts_stashes_where_they_are(evicted):
    sim = simulate(evicted.layout, evicted.programs, CostModel())
    assert [r.peak_activations for r in sim.ranks] == [3, 3, 2, 3]  # rank 3: 1 own + 2 held
    verify(evicted, CostModel(), [3, 3, 2, 3], 3)
    with pytest.raises(
        VerifyError, match="rank 3: counted peak 3 stashes, the simulator reports 1"
    ):
        verify(evicted, CostModel(), [3, 3, 2, 1])


def test_a_stash_is_never_used_while_evicted(evicted):
    broken = edit(
        evicted,
        r0=without(evicted.programs[0], Instr(LOAD, 0, 2, 3)),
        r3=without(evicted.programs[3], Instr(RETURN, 0, 2, 0)),
    )
    with pytest.raises(
        VerifyError,
        match=r"rank 0, instruction \d+ \(BW s=0 mb=2\): uses the stash "
        r"while it is evicted \(EVICT at instruction 5",
    ):
        verify(broken, CostModel())


def test_a_stash_is_loaded_once_and_only_after_an_evict(evicted):
    prog0, prog3 = list(evicted.programs[0]), list(evicted.programs[3])
    k0 = prog0.index(Instr(LOAD, 0, 2, 3)) + 1
    k3 = prog3.index(Instr(RETURN, 0, 2, 0)) + 1
    prog0.insert(k0, Instr(LOAD, 0, 2, 3))
    prog3.insert(k3, Instr(RETURN, 0, 2, 0))
    with pytest.raises(VerifyError, match=r"\(LOAD s=0 mb=2 from=3\): loads a stash that is not"):
        check_residency(edit(evicted, r0=prog0, r3=prog3))


def test_only_an_unread_stash_can_be_evicted(evicted):
    prog0 = without(evicted.programs[0], Instr(EVICT, 0, 2, 3), Instr(LOAD, 0, 2, 3))
    prog0.insert(prog0.index(Instr(Op.BW, 0, 2)) + 1, Instr(EVICT, 0, 2, 3))
    with pytest.raises(
        VerifyError, match=r"\(EVICT s=0 mb=2 to=3\): evicts a stash that is not here"
    ):
        check_residency(edit(evicted, r0=prog0))


def test_every_evict_is_loaded_back_and_every_accept_returned():
    layout = Layout(2, (0, 1), (0, 1), (Pipeline((0, 1), (0,)),))
    opt = Instr(Op.OPTIMIZER_STEP)
    left = Compiled(
        "t",
        2,
        1,
        1,
        layout,
        (
            (Instr(Op.F, 0, 0), Instr(EVICT, 0, 0, 1), opt),
            (Instr(ACCEPT, 0, 0, 0), opt),
        ),
    )
    with pytest.raises(
        VerifyError, match=r"rank 0, instruction 1 \(EVICT s=0 mb=0\): never loaded"
    ):
        check_residency(left)
    only_held = replace(left, programs=((opt,), left.programs[1]))
    with pytest.raises(
        VerifyError, match=r"rank 1, instruction 0 \(ACCEPT s=0 mb=0\): never returned"
    ):
        check_residency(only_held)
    with pytest.raises(VerifyError, match="returns a stash it does not hold"):
        check_residency(replace(left, programs=((opt,), (Instr(RETURN, 0, 0, 0), opt))))


def test_moves_in_mismatched_orders_deadlock(evicted):
    prog3 = list(evicted.programs[3])
    a, r = prog3.index(Instr(ACCEPT, 0, 5, 0)), prog3.index(Instr(RETURN, 0, 2, 0))
    prog3[a], prog3[r] = prog3[r], prog3[a]  # rank 0 evicts mb 5 before it loads mb 2
    with pytest.raises(VerifyError, match=r"deadlock under blocking send/recv: .*EVICT s=0 mb=5"):
        verify(edit(evicted, r3=prog3), CostModel())


@pytest.mark.parametrize(
    "old, new, message",
    [
        (Instr(EVICT, 0, 2, 3), Instr(EVICT, 0, 2, 0), "the peer must be another rank of the 4"),
        (
            Instr(EVICT, 0, 2, 3),
            Instr(EVICT, 1, 2, 3),
            "stage 1 is on rank 1, not on the evicting one 0",
        ),
    ],
)
def test_a_move_names_a_valid_peer(evicted, old, new, message):
    prog0 = [new if i == old else i for i in evicted.programs[0]]
    with pytest.raises(VerifyError, match=message):
        verify(edit(evicted, r0=prog0), CostModel())


def round_trip() -> Compiled:
    """Two ranks; rank 0 evicts its only stash to rank 1 right after F and loads it back."""
    layout = Layout(2, (0, 1), (0, 1), (Pipeline((0, 1), (0,)),))
    opt = Instr(Op.OPTIMIZER_STEP)
    return Compiled(
        "t",
        2,
        1,
        1,
        layout,
        (
            (
                Instr(Op.F, 0, 0),
                Instr(Op.SEND_ACT, 0, 0, 1),
                Instr(EVICT, 0, 0, 1),
                Instr(LOAD, 0, 0, 1),
                Instr(Op.RECV_GRAD, 0, 0, 1),
                Instr(Op.BW, 0, 0),
                opt,
            ),
            (
                Instr(Op.RECV_ACT, 1, 0, 0),
                Instr(ACCEPT, 0, 0, 0),
                Instr(Op.F, 1, 0),
                Instr(Op.BW, 1, 0),
                Instr(RETURN, 0, 0, 0),
                Instr(Op.SEND_GRAD, 1, 0, 0),
                opt,
            ),
        ),
    )


def test_the_acceptor_is_held_to_the_limit():
    """Rank 1 holds its own stash and rank 0's: 2, over a limit of 1.5 that rank 0 meets."""
    with pytest.raises(VerifyError, match=r"rank 1, instruction 2 \(F s=1 mb=0\): 2 stashes live"):
        verify(round_trip(), CostModel(), memory_limit=1.5)


def test_transfers_take_their_link_time_and_gate_the_backward():
    """Two ranks; rank 0 evicts its only stash to rank 1 and loads it back. A stash moves in
    1 time unit, a message (1/16 stash) in 1/16: the evict runs [1, 2]; rank 1 returns the
    stash when it reaches RETURN after its BW (4.0625); it arrives at 5.0625 and only then can
    rank 0's backward start, although the gradient arrived at 4.125."""
    compiled = round_trip()
    layout = compiled.layout
    costs = replace(CostModel(), topology=make_topology(2, 1, None, "intra=1:0"))
    sim = simulate(layout, compiled.programs, costs)
    evict, load = sim.transfers
    assert (evict.kind, evict.src, evict.dst, evict.start, evict.end) == ("evict", 0, 1, 1, 2)
    assert (load.kind, load.src, load.dst, load.start, load.end) == ("load", 1, 0, 4.0625, 5.0625)
    assert sim.timeline[0][-1].start == 5.0625 and sim.makespan == 7.0625
    assert [r.peak_activations for r in sim.ranks] == [1, 2] and sim.moved == 2
    verify(compiled, costs, [1, 2])
    inter = replace(costs, topology=make_topology(2, 2, None, "intra=1:0,inter=0.5:1"))
    assert [t.end - t.start for t in simulate(layout, compiled.programs, inter).transfers] == [3, 3]
