"""The byte prediction (passes/memory_bytes.py) against hand computation: where receives are
posted, every term of a peak, eviction's in-flight buffers and the partner's held stash."""

from dataclasses import replace
from pathlib import Path

import pytest

from pipec.compile import compile_schedule
from pipec.ir import Op
from pipec.model import compile_model
from pipec.passes.costs import CostModel
from pipec.passes.memory_bytes import ByteFacts, post_points, predict_peaks
from pipec.passes.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
COSTS = CostModel(stash_bytes=(1000.0, 2000.0), input_bytes=(100.0, 100.0))
FACTS = ByteFacts(params=(10, 20), param_bytes=(40, 80), message=(100.0, 0.0))


def peaks(result, facts=FACTS, ahead=None):
    c = result.compiled
    return predict_peaks(c.layout, c.programs, result.costs, result.sim, facts, ahead)


def test_post_points_all_at_start_at_place_or_one_compute_ahead():
    # F0 SEND F1 SEND RECV(4) BW RECV(6) BW STEP, as 1F1B's rank 0 at p=2, m=2.
    program = compile_schedule("1f1b", 2, 2, costs=COSTS).compiled.programs[0]
    assert [i.op for i in program][4:7] == [Op.RECV_GRAD, Op.BW, Op.RECV_GRAD]
    assert post_points(program, None) == {0: [4, 6]}
    assert post_points(program, 0) == {4: [4], 6: [6]}
    assert post_points(program, 1) == {2: [4], 5: [6]}  # before F mb1, before BW mb0
    assert post_points(program, 9) == {0: [4, 6]}  # fewer compute ops before: at the start


def test_1f1b_peaks_by_hand():
    """p=2, m=2, every receive posted at the start. Rank 0 after F mb1: two stashes (1000 B
    each) with their outputs kept for the backward (100 B each), both gradient receives
    posted (100 B each), parameters 40 B and AdamW's 8 B per parameter; no gradient yet.
    Rank 1 (the loss stage, no output kept) after F mb0: its stash and mb1's activation
    receive, posted at the start."""
    result = compile_schedule("1f1b", 2, 2, costs=COSTS)
    rank0, rank1 = peaks(result)
    assert rank0.to_json() == {
        "params": 40,
        "optimizer": 80,
        "grads": 0,
        "stash": 2 * 1000 + 2 * 100,
        "buffers": 200,
        "held": 0,
        "host": 0,
        "after": 2,
        "total": 2520,
    }
    assert (rank1.stash, rank1.buffers, rank1.total, rank1.after) == (2000, 100, 2340, 1)
    # Posted one compute op ahead, rank 0 holds one gradient buffer from F mb1 on; at its
    # program position, from the RECV_GRAD (two instructions later) on.
    assert (peaks(result, ahead=1)[0].total, peaks(result, ahead=1)[0].after) == (2420, 2)
    assert (peaks(result, ahead=0)[0].total, peaks(result, ahead=0)[0].after) == (2420, 4)


def test_host_bytes_live_from_forward_to_backward_and_grads_from_the_first_backward():
    result = compile_schedule("1f1b", 2, 2, costs=COSTS)
    facts = ByteFacts((10, 20), (40, 80), (100.0, 0.0), host=(30.0, 50.0))
    rank0, rank1 = peaks(result, facts)
    assert rank0.host == 60 and rank0.total == 2580
    # Rank 1 after BW mb0 holds its gradients (80 B) and the input gradient it sends (100 B)
    # but no stash; its peak stays after F mb0, with one graph's host bytes.
    assert rank1.host == 50 and rank1.after == 1 and rank1.grads == 0


def test_w_held_replaces_the_simulators_share_between_b_and_w():
    result = compile_schedule("zb-h1", 2, 2, costs=COSTS)
    plain = peaks(result)
    measured = peaks(result, ByteFacts((10, 20), (40, 80), (100.0, 0.0), w_held=(0.0, 500.0)))
    # Rank 1's stash between B and W weighs what W holds (500 B) instead of its 2000 B stash.
    assert measured[1].total < plain[1].total
    assert measured[0] == plain[0]  # rank 0's W runs right after its B here: same peak


@pytest.fixture(scope="module")
def tiny_evict():
    return compile_model(f"{ROOT}/examples/gpt.py:tiny", "1f1b", 4, 8, evict=True)


def test_eviction_moves_a_stash_to_the_partner_for_real(tiny_evict):
    """Tiny GPT, 1F1B --evict at p=4: rank 0 holds 3 of its 4 stashes at its peak, rank 3
    one of rank 0's beside its own; an evicted stash's buffer leaves before the next
    instruction that allocates stash bytes."""
    plain = compile_model(f"{ROOT}/examples/gpt.py:tiny", "1f1b", 4, 8)
    facts = ByteFacts.from_plan(tiny_evict.plan)
    assert facts.message == (16384.0, 16384.0, 16384.0, 0.0)  # (2, 32, 64) float32
    before, after = peaks(plain, facts, 1), peaks(tiny_evict, facts, 1)
    stash0 = tiny_evict.costs.stash_bytes[0]
    assert before[0].total - after[0].total == stash0
    assert after[3].held == stash0 and after[3].total - before[3].total == stash0


def test_a_late_partner_keeps_the_evicted_buffer_until_the_next_allocation(tiny_evict):
    """A link so slow that the evicted stash is still travelling when rank 0 runs its next
    forward: the runtime waits there for the send (runtime/offload.py), so the buffer counts
    up to that forward and not after it; rank 0's peak then holds no evicted buffer."""
    slow = replace(tiny_evict.costs, comm=1.0)  # a transfer takes 1 s, an op ~0.1 ms
    c = tiny_evict.compiled
    sim = simulate(c.layout, c.programs, slow)
    assert all(t.end - t.start >= 1.0 for t in sim.transfers)
    facts = ByteFacts.from_plan(tiny_evict.plan)
    slow_peaks = predict_peaks(c.layout, c.programs, slow, sim, facts, 1)
    assert slow_peaks[0].total == peaks(tiny_evict, facts, 1)[0].total
    assert slow_peaks[0].buffers < tiny_evict.costs.stash_bytes[0]


def test_byte_facts_from_a_plan(tiny_evict):
    facts = ByteFacts.from_plan(tiny_evict.plan, host=(1, 2, 3, 4))
    stages = tiny_evict.plan["model"]["stages"]
    assert facts.params == tuple(s["params"] for s in stages)
    assert facts.param_bytes == tuple(s["param_bytes"] for s in stages)
    assert facts.host == (1, 2, 3, 4) and facts.w_held == ()
