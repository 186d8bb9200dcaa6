"""Message batches (passes/batches.py): which instructions an NCCL run issues together, and
that the programs, issued that way, run to the end under NCCL's matching.

`run_as_nccl` plays the programs the way NCCL would in its most serialized case: each rank's
GPU runs its work in launch order (compute, then each batch), a batch finishes once every one
of its messages has met its counterpart, and messages meet per ordered pair of ranks in issue
order, whatever their key (NCCL has no tags). Replica all-reduces meet in order per pair
group. It fails on a message matched with the wrong counterpart and on a deadlock; the last
two tests show both can happen to programs that are not verified.
"""

from __future__ import annotations

from collections import deque

import pytest

from pipec.compile import CompileResult
from pipec.ir import COMPUTE_OPS, TO_PEER_OPS, Compiled, Instr, Layout, Op, Pipeline
from pipec.passes.batches import MOVES_OUT, batch_ends, message_batches
from pipec.passes.execution import counterpart
from pipec.passes.memory_bytes import ALLOCATES
from pipec.passes.registry import SCHEDULES, family
from pipec.passes.rendezvous import MESSAGE_OPS
from tests.helpers import run

family("1f1b")  # registers the built-in families
P, M = 4, 8


def compiled(case: str) -> CompileResult:
    if case == "1f1b --evict":
        return run("1f1b", P, M, memory_limit=3, evict=True)
    v = 2 if case in ("interleaved", "zb-v", "bitpipe") else None
    return run(case, P, M, v)


CASES = ["1f1b", "interleaved", "zb-v", "bitpipe", "1f1b --evict"]


def run_as_nccl(c: Compiled) -> None:
    """Play the programs issued batch by batch, matched in issue order per pair and direction
    (a replica all-reduce: per pair and chunk); AssertionError on a mismatch or a deadlock."""
    programs = c.programs
    units: list[list[tuple[int, ...]]] = []  # per rank: compute positions and batches, in order
    for prog in programs:
        starts = {b[0]: b for b in message_batches(prog)}
        inside = {k for b in starts.values() for k in b}
        kept = [k for k in range(len(prog)) if k in starts or k not in inside]
        units.append([starts.get(k, (k,)) for k in kept])
    channels: dict[tuple, tuple[deque, deque]] = {}  # (from, to) or ("sync", a, b, chunk)
    waiting = [0] * len(programs)  # messages of the rank's current unit not yet met
    pos = [0] * len(programs)
    posted = [False] * len(programs)

    def channel(rank: int, instr: Instr) -> tuple[tuple, int]:
        if instr.op is Op.ALLREDUCE_GRADS:
            a, b = sorted((rank, instr.peer))
            return ("sync", a, b, c.layout.stage_chunk[instr.stage]), int(rank == b)
        sends = instr.op in TO_PEER_OPS
        return ((rank, instr.peer) if sends else (instr.peer, rank)), int(not sends)

    def meet(key: tuple) -> bool:
        first, second = channels[key]
        met = False
        while first and second:
            (a, x), (b, y) = first.popleft(), second.popleft()
            if key[0] != "sync":
                assert counterpart(y, b, c) == x, f"rank {a}'s {x} met rank {b}'s {y}"
            waiting[a] -= 1
            waiting[b] -= 1
            met = True
        return met

    progress = True
    while progress:
        progress = False
        for r, prog in enumerate(programs):
            while pos[r] < len(units[r]):
                unit = units[r][pos[r]]
                talks = [
                    prog[k]
                    for k in unit
                    if prog[k].op in MESSAGE_OPS
                    or (prog[k].op is Op.ALLREDUCE_GRADS and prog[k].peer is not None)
                ]
                if talks and not posted[r]:
                    posted[r], waiting[r] = True, len(talks)
                    for instr in talks:
                        key, side = channel(r, instr)
                        channels.setdefault(key, (deque(), deque()))[side].append((r, instr))
                        progress |= meet(key)
                if waiting[r]:
                    break
                pos[r], posted[r], progress = pos[r] + 1, False, True
    left = [r for r in range(len(programs)) if pos[r] < len(units[r])]
    stuck = [(r, programs[r][units[r][pos[r]][0]]) for r in left]
    assert not stuck, f"deadlock: {stuck}"


@pytest.mark.parametrize("case", CASES)
def test_batches_are_runs_of_messages_and_cover_each_message_once(case):
    for prog in compiled(case).compiled.programs:
        batches = message_batches(prog)
        covered = [k for b in batches for k in b]
        assert covered == [k for k, i in enumerate(prog) if i.op in MESSAGE_OPS]
        for b in batches:
            assert list(b) == list(range(b[0], b[-1] + 1))
        assert batch_ends(prog) == {b[-1] for b in batches}


@pytest.mark.parametrize("case", CASES)
def test_adjacent_send_and_receive_to_one_peer_share_a_batch(case):
    """The pairs that would otherwise go one after the other on the link are issued at once,
    except a LOAD or ACCEPT after a move out of the same run: the runtime first waits for the
    move out to complete (the memory bound)."""
    grouped = 0
    for prog in compiled(case).compiled.programs:
        batch_of = {k: b for b in message_batches(prog) for k in b}
        for k in range(len(prog) - 1):
            a, b = prog[k], prog[k + 1]
            if a.op not in MESSAGE_OPS or b.op not in MESSAGE_OPS or a.peer != b.peer:
                continue
            if (a.op in TO_PEER_OPS) == (b.op in TO_PEER_OPS):
                continue  # two sends or two receives
            run_start = min(batch_of[k])
            split = b.op in ALLOCATES and any(
                prog[j].op in MOVES_OUT for j in range(run_start, k + 1)
            )
            assert (batch_of[k] == batch_of[k + 1]) != split, (prog[k], prog[k + 1])
            grouped += not split
    assert grouped > 0


def test_which_instructions_group_in_1f1b():
    """Rank 1 of 1F1B at p=4, m=8 in its steady state: each batch sends one way and receives
    the other, around one compute instruction."""
    prog = compiled("1f1b").compiled.programs[1]
    text = [tuple(str(prog[k]) for k in b) for b in message_batches(prog)]
    assert ("RECV_GRAD s=1 mb=1 from=2", "SEND_ACT s=1 mb=3 to=2") in text
    assert ("RECV_ACT s=1 mb=5 from=0", "SEND_GRAD s=1 mb=2 to=0") in text
    assert ("RECV_ACT s=1 mb=0 from=0",) == text[0]  # the first receive goes alone
    assert max(map(len, text)) == 3


def test_evictions_batch_with_their_neighbours_but_wait_before_allocating():
    """1F1B --evict at p=4: the acceptor takes one stash and gives another back in one batch;
    the evictor's LOAD after an EVICT starts a new batch (it waits for the EVICT first)."""
    programs = compiled("1f1b --evict").compiled.programs
    text = [[tuple(str(p[k]) for k in b) for b in message_batches(p)] for p in programs]
    assert ("ACCEPT s=0 mb=5 from=0", "RETURN s=0 mb=2 to=0") in text[3]
    assert ("EVICT s=0 mb=5 to=3",) in text[0]
    assert ("LOAD s=0 mb=2 from=3", "SEND_ACT s=0 mb=5 to=1", "RECV_GRAD s=0 mb=2 from=1") in text[
        0
    ]


@pytest.mark.parametrize("case", sorted(SCHEDULES) + ["1f1b --evict"])
def test_every_family_runs_to_the_end_under_nccl_matching(case):
    run_as_nccl(compiled(case).compiled)


def _two_ranks(programs: tuple[tuple[Instr, ...], ...]) -> Compiled:
    layout = Layout(2, (0, 1), (0, 1), (Pipeline((0, 1), (0, 1)),))
    return Compiled("hand", 2, 2, 1, layout, programs)


def test_the_model_sees_a_deadlock_the_verifier_would_refuse():
    """Each rank sends before it receives, with compute between: under NCCL's worst case both
    sends wait for receives that are launched after them."""
    f, b = Instr(Op.F, 0, 0), Instr(Op.BW, 1, 0)
    programs = (
        (f, Instr(Op.SEND_ACT, 0, 0, 1), Instr(Op.F, 0, 1), Instr(Op.RECV_GRAD, 0, 0, 1)),
        (Instr(Op.SEND_GRAD, 1, 0, 0), b, Instr(Op.RECV_ACT, 1, 0, 0)),
    )
    with pytest.raises(AssertionError, match="deadlock"):
        run_as_nccl(_two_ranks(programs))


def test_the_model_sees_messages_matched_out_of_order():
    """Without tags, two activations received in the other order than sent are swapped."""
    sends = (Instr(Op.SEND_ACT, 0, 0, 1), Instr(Op.F, 0, 1), Instr(Op.SEND_ACT, 0, 1, 1))
    receives = (Instr(Op.RECV_ACT, 1, 1, 0), Instr(Op.F, 1, 1), Instr(Op.RECV_ACT, 1, 0, 0))
    with pytest.raises(AssertionError, match="met rank 1's RECV_ACT s=1 mb=1"):
        run_as_nccl(_two_ranks(((Instr(Op.F, 0, 0), *sends), receives)))


def test_compute_never_joins_a_batch():
    for prog in compiled("zb-v").compiled.programs:
        for b in message_batches(prog):
            assert not any(prog[k].op in COMPUTE_OPS for k in b)
