"""The plan on a machine of nodes and links, and its BPipe candidates through the real pass.

Transfers are priced in bytes: a pipeline message carries a chunk's input, an evicted stash
what F left; each crosses its link in latency + bytes / bandwidth (bytes per second).
"""

import pytest
from plan_synthetic import INPUT_PER_SAMPLE, N_BLOCKS, STASH_PER_SAMPLE, synthetic_profile

from pipec.compile import compile_schedule
from pipec.ir import Op, PipecError
from pipec.passes.registry import Request, build_schedule
from pipec.passes.topology import Link, Topology
from pipec.plan.candidates import PlanRequest, cost_model
from pipec.plan.driver import machine, plan_profile

P, BATCH, MBS = 4, 64, 8
CHUNK = N_BLOCKS // P  # blocks per chunk under 1F1B
INTRA, INTER = Link(1e9, 1e-5), Link(1e7, 1e-3)  # bytes/s, s
TWO_NODES = Topology(2, 2, INTRA, INTER)


def flat(n: int) -> float:
    return 0.5


def evaluated(machine_, strategies=("plain",), budget=10**9):
    req = PlanRequest(
        P, BATCH, budget, schedules=("1f1b",), strategies=strategies, machine=machine_
    )
    return plan_profile(synthetic_profile(flat), req).evaluation


def simulated(ev):
    job = ev.request
    return compile_schedule(
        job.schedule, job.p, job.m, job.v, ev.costs, job.memory_limit, **dict(job.options)
    )


def test_a_transfer_costs_latency_plus_its_bytes_over_the_link():
    layout = build_schedule("1f1b", Request(P, BATCH // MBS, 1)).layout
    chunks = synthetic_profile(flat).chunks(P, MBS)
    costs = cost_model(chunks, layout, machine=TWO_NODES)
    message = costs.mem_input * layout.stash_share  # what the simulator sends between stages
    input_bytes, stash_bytes = INPUT_PER_SAMPLE * MBS, CHUNK * STASH_PER_SAMPLE * MBS
    assert costs.transfer_time(0, 1, message) == pytest.approx(1e-5 + input_bytes / 1e9)
    assert costs.transfer_time(1, 2, message) == pytest.approx(1e-3 + input_bytes / 1e7)
    evicted = costs.stash_size(False) * layout.stash_share
    assert costs.transfer_time(3, 0, evicted) == pytest.approx(1e-3 + stash_bytes / 1e7)


def test_pipeline_messages_wait_for_the_link_they_cross():
    one = {e.mbs: e for e in evaluated(None).fits}
    two = {e.mbs: e for e in evaluated(TWO_NODES).fits}
    for mbs, ev in two.items():
        assert ev.iteration_s > one[mbs].iteration_s  # the slow inter-node link costs time
        sim = simulated(ev).sim
        start = {
            (s.instr.stage, s.instr.mb): s.start
            for t in sim.timeline
            for s in t
            if s.instr.op is Op.F
        }
        end = {
            (s.instr.stage, s.instr.mb): s.end
            for t in sim.timeline
            for s in t
            if s.instr.op is Op.F
        }
        crossing = 1e-3 + INPUT_PER_SAMPLE * mbs / 1e7
        for mb in range(ev.m):
            assert start[(2, mb)] - end[(1, mb)] >= crossing - 1e-12  # node 0 -> node 1
            assert start[(1, mb)] - end[(0, mb)] >= 1e-5  # within node 0


def half_a_stash_short(machine_) -> int:
    """A budget half a stash below plain 1F1B's rank 0 at MBS, where it holds 4 stashes of
    CHUNK * STASH_PER_SAMPLE * MBS bytes: room for 3.5 beside what eviction cannot move."""
    plain = next(e for e in evaluated(machine_).fits if e.mbs == MBS)
    return plain.memory[0].total - CHUNK * STASH_PER_SAMPLE * MBS // 2


def test_evict_candidates_run_the_bpipe_pass_and_count_stashes_on_acceptors():
    stash = CHUNK * STASH_PER_SAMPLE * MBS
    budget = half_a_stash_short(None)
    ev = evaluated(None, ("plain", "evict"), budget)
    plain = next(e for e in ev.over if e.mbs == MBS and e.strategy == "plain")
    evict = next(e for e in ev.fits if e.mbs == MBS and e.strategy == "evict")
    # Rank 0 holds the most beside its stashes, at its peak: the limit is 3.5 stashes.
    assert evict.request.options == (("evict", True),)
    assert evict.request.memory_limit == pytest.approx(3.5)
    result = simulated(evict)
    ops = {i.op for prog in result.compiled.programs for i in prog}
    assert {Op.EVICT, Op.LOAD, Op.ACCEPT, Op.RETURN} <= ops
    moved = {(t.src, t.dst) for t in result.sim.transfers if t.kind == "evict"}
    assert moved == {(0, 3)}  # BPipe's pair: the first rank with the last
    # Rank 0 sheds stashes to rank 3, which holds them beside its own: up to the limit.
    stashes = [r.peak_stash_bytes for r in simulated(plain).sim.ranks]
    assert stashes == [4 * stash, 3 * stash, 2 * stash, stash]
    assert [r.peak_stash_bytes for r in result.sim.ranks] == [
        3 * stash,
        3 * stash,
        2 * stash,
        3 * stash,
    ]
    assert evict.memory[0].total == plain.memory[0].total - stash  # one stash fewer at its peak
    assert evict.memory[3].held > 0 and evict.peak_bytes <= budget


def test_evicted_stashes_cross_the_link_between_the_pair():
    ev = evaluated(TWO_NODES, ("plain", "evict"), half_a_stash_short(TWO_NODES))
    evict = next(e for e in ev.fits if e.mbs == MBS and e.strategy == "evict")
    moves = simulated(evict).sim.transfers
    stash_bytes = CHUNK * STASH_PER_SAMPLE * MBS
    assert moves and all(
        t.end - t.start == pytest.approx(1e-3 + stash_bytes / 1e7) for t in moves
    )  # ranks 0 and 3 sit on different nodes


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, None, ""), "--nodes/--gpus-per-node price transfers by the links"),
        ((3, None, "intra=1e9:0,inter=1e8:0"), "--nodes 3 x --gpus-per-node 1 is 3 GPUs"),
        ((2, 2, "intra=fast:0"), "--link intra bandwidth: 'fast' is not a number"),
    ],
)
def test_bad_machine_is_one_line(args, message):
    with pytest.raises(PipecError, match=message) as e:
        machine(P, *args)
    assert "\n" not in str(e.value)


def test_comm_and_link_are_one_or_the_other():
    with pytest.raises(PipecError, match="--comm and --link"):
        machine(P, None, None, "intra=1e9:0", 1e-3)
