"""Happens-before between the messages of finished programs: where a new message may go.

Under blocking point-to-point semantics every matched pair of message instructions (a send
and its receive, or the two halves of a stash move) is one event shared by two ranks, and the
programs are deadlock-free when program order plus these events has no cycle. A pass that adds
a message between ranks e and a (evictions) may put it after e's j-th and a's i-th message
exactly when no message after either point happens before the other point:

    knows_a(e, j) <= i   and   knows_e(a, i) <= j

where knows_a(e, j) counts a's messages that happen before e's point after its j-th message
(a two-component vector clock). New messages of one rank pair, placed in the same order on
both ranks and each passing this test, keep the programs deadlock-free: a cycle would need a
chain from after one of them back to before it, which the test excludes.
"""

from __future__ import annotations

from passes.verify import counterpart
from pipec.ir import MEMORY_OPS, RECV_OPS, SEND_OPS, Compiled, PipecError

MESSAGE_OPS = SEND_OPS | RECV_OPS | MEMORY_OPS
Event = tuple[int, int]
"""The two ranks of one matched message."""


def events(compiled: Compiled) -> list[Event]:
    """Every matched message, in an order that agrees with every rank's program.

    A rank runs until a message whose counterpart its peer has not reached, and leaves an
    offer there; the peer takes it up when it arrives. Each message is looked at once.
    PipecError when the programs deadlock (verify them first)."""
    programs = compiled.programs
    n = len(programs)
    msgs = [[i for i in prog if i.op in MESSAGE_OPS] for prog in programs]
    pos = [0] * n
    offers: dict[tuple, int] = {}  # (rank, what it must reach) -> who waits there
    out: list[Event] = []
    ready = list(range(n))
    while ready:
        r = ready.pop()
        ms = msgs[r]
        while pos[r] < len(ms):
            instr = ms[pos[r]]
            q = offers.pop((r, instr.op, instr.stage, instr.mb, instr.peer), None)
            if q is None:
                c = counterpart(instr, r, compiled)
                offers[(instr.peer, c.op, c.stage, c.mb, c.peer)] = r
                break
            out.append((r, q))
            pos[r] += 1
            pos[q] += 1
            ready.append(q)
    stuck = [r for r in range(n) if pos[r] < len(msgs[r])]
    if stuck:
        r = stuck[0]
        raise PipecError(
            f"the programs deadlock (rank {r} blocks at {msgs[r][pos[r]]}); verify them first"
        )
    return out


def knowledge(evs: list[Event], n: int, e: int, a: int) -> tuple[list[int], list[int]]:
    """(knows_a on e, knows_e on a): entry j is taken after the rank's j-th message."""
    knows_e, knows_a = [0] * n, [0] * n
    count_e = count_a = 0
    on_e, on_a = [0], [0]
    for r, q in evs:
        x = max(knows_e[r], knows_e[q])
        y = max(knows_a[r], knows_a[q])
        if e in (r, q):
            count_e += 1
            x = count_e
        if a in (r, q):
            count_a += 1
            y = count_a
        knows_e[r] = knows_e[q] = x
        knows_a[r] = knows_a[q] = y
        if e in (r, q):
            on_e.append(y)
        if a in (r, q):
            on_a.append(x)
    return on_e, on_a
