"""The communication layer without a process group: a send's buffers go when it completes
(polled works, as NCCL reports them, and gloo's lanes), and a stash buffer's size comes from
the plan on both sides (no size message, no host wait)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pipec.ir import Op
from pipec.model import compile_model
from runtime import offload, p2p
from runtime.p2p import Comm, Kind

ROOT = Path(__file__).resolve().parents[1]


class FakeWork:
    """A send work that completes when told to; `wait` blocks until then (as gloo's does)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def is_completed(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout=None) -> bool:  # type: ignore[no-untyped-def]
        self.event.wait()
        return True


@pytest.fixture
def works(monkeypatch):
    issued: list[FakeWork] = []

    def isend(tensor, dst, tag):  # type: ignore[no-untyped-def]
        issued.append(FakeWork())
        return issued[-1]

    monkeypatch.setattr(p2p.dist, "isend", isend)
    return issued


def sent(comm: Comm, kind: Kind = Kind.GRAD) -> StorageWeakRef:
    """Send one fresh tensor; a weak reference to its storage (nothing else holds it)."""
    t = torch.ones(1000)
    ref = StorageWeakRef(t.untyped_storage())
    comm.send(kind, 1, 0, 0, [t])
    return ref


def test_polled_sends_go_when_their_work_completes(works):
    """NCCL's path: issued in place; each poll asks the works, and the completed go."""
    comm = Comm(lambda r: r, n_stages=2, m=2, timeout=5.0)
    first, second = sent(comm), sent(comm, Kind.ACT)
    comm.poll()
    assert len(comm.in_flight) == 2 and not first.expired()
    works[0].event.set()
    comm.clock = 7
    comm.poll()
    assert first.expired() and not second.expired()
    assert [out.key for out in comm.in_flight] == [(Kind.ACT, 1, 0)]
    works[1].event.set()
    comm.complete(frozenset({Kind.ACT}))
    assert second.expired() and comm.in_flight == []


def test_a_lane_drops_its_buffers_the_moment_the_send_completes(works):
    """gloo's path: a destination's lane issues and waits; the buffer goes without a poll."""
    comm = Comm(lambda r: r, n_stages=2, m=2, timeout=5.0, lanes=True)
    ref = sent(comm, Kind.STASH)
    out = comm.in_flight[0]
    assert not out.done.wait(0.05) and not ref.expired()
    while not works:  # the lane issues it
        threading.Event().wait(0.001)
    works[0].event.set()
    assert out.done.wait(5.0)
    assert ref.expired() and out.completed_at == 0
    comm.poll()
    assert comm.in_flight == []


def test_complete_waits_only_for_the_kinds_asked(works):
    comm = Comm(lambda r: r, n_stages=2, m=2, timeout=5.0)
    sent(comm, Kind.STASH), sent(comm, Kind.GRAD)
    works[0].event.set()  # only the stash's work can complete: the gradient's would block
    comm.complete(frozenset({Kind.STASH, Kind.STASH_BACK}))
    assert [out.key[0] for out in comm.in_flight] == [Kind.GRAD]


def test_drain_refuses_a_receive_never_consumed(works, monkeypatch):
    monkeypatch.setattr(p2p.dist, "irecv", lambda buffer, src, tag: FakeWork())
    comm = Comm(lambda r: r, n_stages=2, m=2, timeout=5.0)
    comm.post(Kind.ACT, 0, 1, 0, [torch.empty(4)])
    with pytest.raises(RuntimeError, match="1 receives never consumed, e.g. ACT s=0 mb=1"):
        comm.drain()


@pytest.mark.parametrize("recompute", [False, True])
def test_both_sides_size_a_stash_buffer_from_the_plan(recompute):
    """The evictor packs exactly the chunk's stash bytes (its input bytes when the forward is
    recomputed) and the acceptor allocates the same: `buffer_bytes` reads only the plan, which
    both ranks hold."""
    family = "1f1b-r" if recompute else "1f1b"
    result = compile_model(f"{ROOT}/examples/gpt.py:tiny", family, 4, 8, evict=True)
    c = result.compiled
    rank = SimpleNamespace(layout=c.layout, build=SimpleNamespace(compiled=c, costs=result.costs))
    facts = result.costs.input_bytes if recompute else result.costs.stash_bytes
    accepted = [i for prog in c.programs for i in prog if i.op is Op.ACCEPT]
    assert accepted
    for i in accepted:
        assert offload.buffer_bytes(rank, i.stage, i.mb) == facts[c.layout.stage_chunk[i.stage]]
