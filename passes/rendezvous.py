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

from pipec.ir import MEMORY_OPS, RECV_OPS, SEND_OPS, Compiled, Instr, PipecError
from pipec.passes.execution import counterpart

MESSAGE_OPS = SEND_OPS | RECV_OPS | MEMORY_OPS


Keys = tuple[list[tuple], list[tuple]]
"""A rank's messages: for each, what it is (rank, op, stage, mb, peer) and what its peer must
reach to match it, in the same form."""


def message_keys(compiled: Compiled, rank: int, memo: dict[Instr, tuple]) -> Keys:
    """The keys of `rank`'s messages; `memo` keeps each message's counterpart key, so that a
    pass that changes a program pays only for its new messages."""
    own, want = [], []
    for instr in compiled.programs[rank]:
        if instr.op in MESSAGE_OPS:
            other = memo.get(instr)
            if other is None:
                c = counterpart(instr, rank, compiled)
                other = memo[instr] = (instr.peer, c.op, c.stage, c.mb, c.peer)
            own.append((rank, instr.op, instr.stage, instr.mb, instr.peer))
            want.append(other)
    return own, want


def knowledge(compiled: Compiled, keys: list[Keys], e: int, a: int) -> tuple[list[int], list[int]]:
    """(knows_a on e, knows_e on a): entry j is taken after the rank's j-th message; `keys`
    are every rank's `message_keys`.

    The matched messages are walked in an order that agrees with every rank's program: a rank
    runs until a message whose counterpart its peer has not reached and leaves an offer there;
    the peer takes it up when it arrives. Each message is looked at once. PipecError when the
    programs deadlock (verify them first)."""
    n = len(keys)
    knows_e, knows_a = [0] * n, [0] * n  # per rank: e's and a's messages it has heard of
    on_e, on_a = [0], [0]
    pos = [0] * n
    offers: dict[tuple, int] = {}  # (rank, what it must reach) -> who waits there
    ready = list(range(n))
    while ready:
        r = ready.pop()
        own, want = keys[r]
        k, end = pos[r], len(own)
        while k < end:
            q = offers.pop(own[k], None)
            if q is None:
                offers[want[k]] = r
                break
            k += 1
            pos[q] += 1
            ready.append(q)
            with_e, with_a = r == e or q == e, r == a or q == a
            if not (with_e or with_a):  # the common case, kept cheap: both learn what either knew
                if knows_e[r] != knows_e[q]:
                    knows_e[r] = knows_e[q] = max(knows_e[r], knows_e[q])
                if knows_a[r] != knows_a[q]:
                    knows_a[r] = knows_a[q] = max(knows_a[r], knows_a[q])
                continue
            x = len(on_e) if with_e else max(knows_e[r], knows_e[q])
            y = len(on_a) if with_a else max(knows_a[r], knows_a[q])
            if with_a:
                on_a.append(x)
            if with_e:
                on_e.append(y)
            knows_e[r] = knows_e[q] = x
            knows_a[r] = knows_a[q] = y
        pos[r] = k
    stuck = [r for r in range(n) if pos[r] < len(keys[r][0])]
    if stuck:
        r = stuck[0]
        at = [i for i in compiled.programs[r] if i.op in MESSAGE_OPS][pos[r]]
        raise PipecError(f"the programs deadlock (rank {r} blocks at {at}); verify them first")
    return on_e, on_a
