"""The communication layer without a process group: a send's buffers go when it completes
(polled works, as NCCL reports them, and gloo's lanes); NCCL's batches are issued together, in
order, without tags; on CUDA a send waits for the compute that produced it and a receive for
nothing but the messages before it (stand-in streams); staged messages cross host memory; and a
stash buffer's size comes from the plan on both sides (no size message, no host wait)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pipec.compile import compile_schedule
from pipec.ir import Op
from pipec.model import compile_model
from pipec.runtime import offload, p2p
from pipec.runtime import rank as rank_module
from pipec.runtime.p2p import Comm, Kind, Links
from pipec.runtime.rank import Rank
from pipec.runtime.step_state import StashBytes
from pipec.runtime.transport import CommStream, Transport

ROOT = Path(__file__).resolve().parents[1]
NCCL = Transport("nccl")
SPEC = [((1000,), torch.float32)]


class FakeWork:
    """A work that completes when told to; `wait` blocks until then (as gloo's does)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.waits: list = []  # the timeout of each wait: None is NCCL's stream-only wait
        self.thread = threading.current_thread()  # the thread that issued it

    def is_completed(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout=None) -> bool:  # type: ignore[no-untyped-def]
        self.waits.append(timeout)
        self.event.wait()
        return True


def FakeP2POp(op, tensor, peer, tag):  # type: ignore[no-untyped-def]
    """dist.P2POp without a process group."""
    return SimpleNamespace(op=op, tensor=tensor, peer=peer, tag=tag)


@pytest.fixture
def works(monkeypatch):
    """Every work issued, in order: lone isend/irecv, and a work per op of a batch (as gloo
    answers batch_isend_irecv). `works.batches` lists each batch's ops."""
    issued: list[FakeWork] = []
    batches: list[list] = []
    groups: list[tuple[str, int, object]] = []  # each lone op's (kind, peer, group)

    def isend(tensor, peer, tag, group=None):  # type: ignore[no-untyped-def]
        groups.append(("send", peer, group))
        issued.append(FakeWork())
        return issued[-1]

    def irecv(tensor, peer, tag, group=None):  # type: ignore[no-untyped-def]
        issued.append(FakeWork())
        groups.append(("recv", peer, group))
        return issued[-1]

    def batch_isend_irecv(ops):  # type: ignore[no-untyped-def]
        batches.append([(op.op, op.peer, op.tag) for op in ops])  # not the tensors: kept alive
        return [isend(op.tensor, op.peer, op.tag) for op in ops]

    monkeypatch.setattr(p2p.dist, "isend", isend)
    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(p2p.dist, "P2POp", FakeP2POp)
    issued_with_batches = SimpleNamespace(list=issued, batches=batches, groups=groups)
    return issued_with_batches


def sent(comm: Comm, kind: Kind = Kind.GRAD, mb: int = 0) -> StorageWeakRef:
    """Send one fresh tensor; a weak reference to its storage (nothing else holds it)."""
    t = torch.ones(1000)
    ref = StorageWeakRef(t.untyped_storage())
    comm.send(kind, 1, mb, 0, [t])
    return ref


def nccl_comm(**kw) -> Comm:  # type: ignore[no-untyped-def]
    return Comm(lambda r: r, n_stages=2, m=2, timeout=5.0, transport=NCCL, **kw)


def test_polled_sends_go_when_their_work_completes(works):
    """NCCL's path: each poll asks the works, and the completed go."""
    comm = nccl_comm()
    first, second = sent(comm), sent(comm, Kind.ACT)
    comm.flush()
    comm.poll()
    assert len(comm.in_flight) == 2 and not first.expired()
    works.list[0].event.set()
    comm.clock = 7
    comm.poll()
    assert first.expired() and not second.expired()
    assert [out.key for out in comm.in_flight] == [(Kind.ACT, 1, 0)]
    works.list[1].event.set()
    comm.complete(frozenset({Kind.ACT}))
    assert second.expired() and comm.in_flight == []


def test_a_batch_is_issued_together_in_order_without_tags(works):
    """Nothing leaves before the batch's end; then one batch_isend_irecv holds its messages in
    program order, every tensor tagged 0 (NCCL matches in issue order and has no tags)."""
    comm = nccl_comm()
    sent(comm, Kind.ACT)
    comm.post(Kind.GRAD, 1, 0, 1, SPEC * 2)
    comm.poll()  # between the batch's instructions: the send is not issued, so not complete
    assert works.batches == [] and len(comm.in_flight) == 1
    comm.flush()
    isend, irecv = p2p.dist.isend, p2p.dist.irecv
    assert works.batches == [[(isend, 0, 0), (irecv, 1, 0), (irecv, 1, 0)]]
    comm.flush()  # an empty batch issues nothing
    assert len(works.batches) == 1


def test_one_coalesced_work_completes_every_message_of_its_batch(monkeypatch):
    """NCCL answers a batch with one work: each message of the batch waits for it."""
    work = FakeWork()
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", lambda ops: [work])
    monkeypatch.setattr(p2p.dist, "P2POp", FakeP2POp)
    comm = nccl_comm()
    ref = sent(comm, Kind.ACT)
    comm.post(Kind.GRAD, 1, 0, 1, SPEC * 2)
    comm.flush()
    assert comm.in_flight[0].works == [work] and comm.posted[(Kind.GRAD, 1, 0)].works == [work]
    comm.poll()
    assert not ref.expired()
    work.event.set()
    assert [b.shape for b in comm.take(Kind.GRAD, 1, 0)] == [(1000,), (1000,)]
    comm.poll()
    assert ref.expired() and comm.in_flight == []


def test_a_wait_issues_what_it_waits_for_first(works):
    """A receive taken, or a send completed, while still in the open batch is issued before
    the wait (it could never complete otherwise)."""
    comm = nccl_comm()
    comm.post(Kind.ACT, 0, 1, 0, SPEC)
    threading.Timer(0.05, lambda: works.list[0].event.set()).start()
    comm.take(Kind.ACT, 0, 1)
    assert len(works.batches) == 1
    sent(comm, Kind.STASH)
    threading.Timer(0.05, lambda: works.list[1].event.set()).start()
    comm.complete()
    assert len(works.batches) == 2 and comm.in_flight == []


def test_a_lane_drops_its_buffers_the_moment_the_send_completes(works):
    """gloo's path: the send instruction issues the message (its receive was posted at the
    step's start), its destination's lane waits for it; the buffer goes without a poll."""
    comm = Comm(lambda r: r, n_stages=2, m=2, timeout=5.0)
    ref = sent(comm, Kind.STASH)
    out = comm.in_flight[0]
    assert [w.thread for w in works.list] == [threading.current_thread()]  # not the lane's
    assert not comm.wait_finished(out, 0.05) and not ref.expired()
    works.list[0].event.set()
    assert comm.wait_finished(out, 5.0)
    assert ref.expired() and out.completed_at == 0
    comm.poll()
    assert comm.in_flight == []


def test_complete_waits_only_for_the_kinds_asked(works):
    comm = nccl_comm()
    sent(comm, Kind.STASH), sent(comm, Kind.GRAD)
    comm.flush()
    works.list[0].event.set()  # only the stash's work can complete: the gradient's would block
    comm.complete(frozenset({Kind.STASH, Kind.STASH_BACK}))
    assert [out.key[0] for out in comm.in_flight] == [Kind.GRAD]


def test_drain_refuses_a_receive_never_consumed(works):
    comm = nccl_comm()
    comm.post(Kind.ACT, 0, 1, 0, SPEC)
    with pytest.raises(RuntimeError, match="1 receives never consumed, e.g. ACT s=0 mb=1"):
        comm.drain()


def test_staged_messages_cross_host_copies(works):
    """gloo carries host tensors only: a send puts copies on the wire and keeps the device
    tensors until it completes (an NCCL send would hold them as long); a receive lands in host
    buffers and is copied into the consumer's buffers when taken."""
    comm = Comm(lambda r: r, 2, 2, 5.0, transport=Transport("gloo", staged=True))
    t = torch.arange(6.0)
    comm.send(Kind.ACT, 1, 0, 0, [t])
    out = comm.in_flight[0]
    (copy,) = out.wire
    assert copy is not t and torch.equal(copy, t)
    assert t.untyped_storage()._cdata in {x.untyped_storage()._cdata for x in out.tensors}
    comm.post(Kind.GRAD, 1, 0, 0, [((6,), torch.float32)])
    entry = comm.posted[(Kind.GRAD, 1, 0)]
    (host,), (buffer,) = entry.wire, entry.buffers
    assert host.data_ptr() != buffer.data_ptr()
    host.copy_(torch.full((6,), 3.0))  # the transfer writes the host buffer
    while len(works.list) < 2:  # the lane issues the send, once copied; `post`, the receive
        threading.Event().wait(0.001)
    here = sorted(w.thread is threading.current_thread() for w in works.list)
    assert here == [False, True]  # in either order
    for w in works.list:
        w.event.set()
    (got,) = comm.take(Kind.GRAD, 1, 0)
    assert got is buffer and torch.equal(got, torch.full((6,), 3.0))
    comm.complete()
    assert comm.in_flight == [] and out.tensors == ()


def test_each_backend_gets_its_transport():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert Transport.for_run("nccl", cuda) == Transport("nccl")
    assert Transport.for_run("gloo", cpu) == Transport("gloo")
    assert Transport.for_run("gloo", cuda) == Transport("gloo", staged=True, pinned=True)


class FakeStream:
    """A CUDA stream's queue: each entry is work, or a wait for another stream's queue up to a
    point (an event recorded there)."""

    def __init__(self, name: str) -> None:
        self.name, self.queue = name, []

    def launch(self, label: str) -> tuple[FakeStream, int]:
        self.queue.append(label)
        return self, len(self.queue) - 1

    def wait_stream(self, other: FakeStream) -> None:
        self.queue.append((other, len(other.queue)))


def before(a: tuple[FakeStream, int], b: tuple[FakeStream, int]) -> bool:
    """Whether work `a` is ordered before work `b` (stream order plus waits)."""
    seen, todo = set(), [(b[0], b[1])]
    while todo:
        stream, end = todo.pop()
        for i in range(end):
            if (id(stream), i) in seen:
                continue
            seen.add((id(stream), i))
            entry = stream.queue[i]
            if isinstance(entry, tuple):
                todo.append(entry)
    return (id(a[0]), a[1]) in seen


class FakeGPU:
    """Stand-ins for torch.cuda's current stream and ProcessGroupNCCL: a batch runs on NCCL's
    stream after it waits for the stream current at the call, and a work's `wait()` makes the
    current stream wait for it."""

    def __init__(self, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        self.compute, self.comm, self.nccl = (FakeStream(n) for n in ("compute", "comm", "nccl"))
        self.current = self.compute
        self.recorded: list[tuple[torch.Tensor, FakeStream]] = []
        self.transfers: list[tuple[FakeStream, int]] = []  # each batch's place on NCCL's stream
        monkeypatch.setattr(p2p.dist, "batch_isend_irecv", self.batch)
        monkeypatch.setattr(p2p.dist, "P2POp", FakeP2POp)

    @contextmanager
    def use(self, stream: FakeStream):  # type: ignore[no-untyped-def]
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved

    def batch(self, ops):  # type: ignore[no-untyped-def]
        self.nccl.wait_stream(self.current)
        at = self.nccl.launch(f"{len(ops)} transfers")
        self.transfers.append(at)
        gpu = self

        class Work:
            def wait(self, timeout=None):  # type: ignore[no-untyped-def]
                assert timeout is None, "a timeout would block the host"
                gpu.current.wait_stream(at[0])

        return [Work()]


def test_on_cuda_a_send_waits_for_its_producer_and_a_receive_for_no_compute(monkeypatch):
    gpu = FakeGPU(monkeypatch)
    stream = CommStream(
        torch.device("cuda"),
        gpu.comm,
        gpu.compute,
        gpu.use,
        lambda t, s: gpu.recorded.append((t, s)),
    )
    comm = nccl_comm(stream=stream)
    forward = gpu.compute.launch("F mb=0")
    comm.send(Kind.ACT, 0, 0, 1, [torch.ones(3)])
    comm.flush()
    later = gpu.compute.launch("F mb=1")  # queued after the send was issued
    comm.post(Kind.GRAD, 1, 0, 1, SPEC)
    comm.flush()
    send, receive = gpu.transfers
    assert before(forward, send)  # the activation is computed before it leaves
    assert not before(later, receive)  # the receive does not wait for unrelated compute
    (buffer,) = comm.take(Kind.GRAD, 1, 0)
    backward = gpu.compute.launch("B mb=0")
    assert before(receive, backward)  # the consumer waits for the transfer
    assert gpu.recorded == [(buffer, gpu.compute)]  # its memory is read on the compute stream
    assert comm.waited == 0.0  # the host did not wait


def test_issued_from_the_compute_stream_a_receive_would_wait_for_compute(monkeypatch):
    """What the comm stream avoids: the stand-in shows the false wait when it is bypassed."""
    gpu = FakeGPU(monkeypatch)
    later = gpu.compute.launch("F mb=1")
    with gpu.use(gpu.compute):
        gpu.batch([SimpleNamespace(op=p2p.dist.irecv)])
    assert before(later, gpu.transfers[0])


@pytest.mark.parametrize("recompute", [False, True])
def test_both_sides_size_a_stash_buffer_from_the_plan(recompute):
    """The evictor packs exactly the chunk's stash bytes (its input bytes when the forward is
    recomputed) and the acceptor allocates the same: `buffer_bytes` reads only the plan, which
    both ranks hold, or the figures every rank agreed on at start (`size_moves`, a run at
    another precision than the plan's)."""
    family = "1f1b-r" if recompute else "1f1b"
    result = compile_model(f"{ROOT}/examples/gpt.py:tiny", family, 4, 8, evict=True)
    c = result.compiled
    build = SimpleNamespace(compiled=c, costs=result.costs)
    rank = SimpleNamespace(layout=c.layout, build=build, stash_bytes=StashBytes())
    facts = result.costs.input_bytes if recompute else result.costs.stash_bytes
    accepted = [i for prog in c.programs for i in prog if i.op is Op.ACCEPT]
    assert accepted
    for i in accepted:
        assert offload.buffer_bytes(rank, i.stage, i.mb) == facts[c.layout.stage_chunk[i.stage]]
    rank.stash_bytes = StashBytes(moved=tuple(range(100, 100 + len(facts))))
    for i in accepted:
        assert offload.buffer_bytes(rank, i.stage, i.mb) == 100 + c.layout.stage_chunk[i.stage]


def test_gloo_messages_travel_in_their_directions_group(works):
    """A send goes in the group of its destination's direction, a receive in its source's;
    a peer without one uses the world's group (None)."""
    out_to_1, in_from_1 = object(), object()
    comm = Comm(lambda r: r, 2, 2, 5.0, links=Links({1: out_to_1}, {1: in_from_1}))
    comm.send(Kind.ACT, 0, 0, 1, [torch.ones(2)])
    comm.post(Kind.GRAD, 1, 0, 1, SPEC)
    comm.send(Kind.ACT, 0, 1, 2, [torch.ones(2)])
    assert works.groups == [("send", 1, out_to_1), ("recv", 1, in_from_1), ("send", 2, None)]
    for w in works.list:
        w.event.set()


@pytest.mark.parametrize("dp", [1, 2])
def test_every_rank_makes_a_group_per_direction_in_the_same_order(monkeypatch, dp):
    """Rank.connect's links: each direction between two ranks that message each other gets a
    group of its own, and every rank (members or not) creates them in one order, as
    dist.new_group requires."""
    compiled = compile_schedule("1f1b", 3, 4).compiled
    made: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        rank_module.dist, "new_group", lambda ranks: made.append(tuple(ranks)) or len(made)
    )
    calls, links = [], {}
    for g in range(3 * dp):
        made.clear()
        fake = SimpleNamespace(build=SimpleNamespace(compiled=compiled), dp=dp, grank=g)
        links[g] = Rank._links(fake)
        calls.append(list(made))
    assert all(c == calls[0] for c in calls)  # one order on every rank
    pairs = [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert calls[0] == [tuple(sorted((d * 3 + a, d * 3 + b))) for d in range(dp) for a, b in pairs]
    assert sorted(links[1].send) == [0, 2] and sorted(links[1].recv) == [0, 2]
    assert sorted(links[0].send) == [1] and sorted(links[3 * dp - 1].recv) == [3 * dp - 2]
    assert links[1].send[0] != links[1].recv[0]  # each direction its own group
