"""A candidate's peak bytes per rank (the runtime's prediction, priced from the plan's chunks)
checked against hand computation; the eviction limit a byte budget implies; byte sizes as the
CLI reads them."""

import pytest

from pipec.codegen.render import format_bytes
from pipec.compile import compile_schedule
from pipec.ir import PipecError
from pipec.passes.memory_bytes import optimizer_bytes
from pipec.passes.registry import Request, build_schedule, family
from pipec.plan.candidates import cost_model
from pipec.plan.facts import FBW, Chunks
from pipec.plan.memory import parse_bytes, predicted, stash_limit
from pipec.runtime.calibration import GLOO_RECV_HOST


def chunks(stash, params=(1000,), param_bytes=None, message=None) -> Chunks:
    """Chunks whose input is 1/16 of their stash, and whose output message is the next
    chunk's input (none after the last), unless `message` says otherwise."""
    n = len(stash)
    params = params * n if len(params) == 1 else params
    inputs = tuple(s // 16 for s in stash)
    return Chunks(
        counts=(1,) * n,
        seconds=(FBW(1.0, 1.0, 1.0),) * n,
        stash_bytes=tuple(stash),
        input_bytes=inputs,
        params=tuple(params),
        param_bytes=tuple(param_bytes or [4 * x for x in params]),
        message_bytes=tuple(message) if message is not None else (*inputs[1:], 0),
    )


def compiled(schedule, p, m, ch):
    layout = build_schedule(schedule, Request(p, m, family(schedule).default_v)).layout
    return compile_schedule(schedule, p, m, None, cost_model(ch, layout))


def memory(schedule, p, m, ch, device="cuda"):
    """Each rank's predicted peak, for a GPU run unless `device` says otherwise."""
    return tuple(s.peak() for s in predicted(compiled(schedule, p, m, ch), ch, device))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("123456", 123456),
        ("64 kib", 65536),
        ("1e9", 10**9),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80 apples", "", "GiB", "-1GiB", "0"])
def test_parse_bytes_refuses_nonsense_with_one_line(text):
    with pytest.raises(PipecError, match="--memory-per-device") as e:
        parse_bytes(text)
    assert "\n" not in str(e.value)


def test_format_bytes():
    assert format_bytes(529152) == "517 KiB" and format_bytes(512) == "512 B"
    assert format_bytes(80 * 2**30) == "80 GiB"


def test_adamw_state_as_the_runtime_holds_it():
    assert optimizer_bytes(1000, 4000) == 8000  # fp32: two moments
    assert optimizer_bytes(1000, 2000) == 4000  # a bf16 model at fp32: moments in bf16
    assert optimizer_bytes(1000, 4000, "bf16") == 12000  # bf16: fp32 moments + fp32 master
    assert optimizer_bytes(1000, 4000, "bf16", zero=2) == 6000  # ZeRO-1 over 2 copies


def test_1f1b_rank_memory_by_hand():
    # Rank r of 1F1B keeps p - r micro-batches in flight, each a stash and the stage output
    # kept for its backward (message[r]); NCCL posts a receive in place. Rank 0 peaks once a
    # gradient arrives in the steady state: its gradients exist. Ranks 1 and 2 peak before
    # their first backward (no gradients yet), holding the next activation received and the
    # first gradient. The last rank keeps no output and peaks after its second forward.
    stash, params = [1000, 2000, 3000, 4000], (10, 20, 30, 40)
    message = [125, 187, 250, 0]  # the next chunk's input: its stash / 16
    got = memory("1f1b", 4, 8, chunks(stash, params=params))
    for r, mem in enumerate(got):
        weights = 4 * params[r]
        assert (mem.params, mem.optimizer, mem.held, mem.host) == (weights, 2 * weights, 0, 0)
    assert got[0].grads == 40 and got[0].buffers == 125
    assert got[0].stash == 4 * (stash[0] + message[0])
    for r in (1, 2):
        assert got[r].grads == 0 and got[r].buffers == message[r - 1] + message[r]
        assert got[r].stash == (4 - r) * (stash[r] + message[r])
    assert (got[3].grads, got[3].stash, got[3].buffers) == (160, 4000, 0)
    assert [m.total for m in got] == [4785, 7113, 7297, 4640]


def test_1f1b_recompute_keeps_inputs_and_one_full_stash():
    # Rank r < 3 peaks once the gradient of micro-batch 1 arrives: the inputs of the p - r - 1
    # micro-batches still in flight (input = stash/16), micro-batch 1's recomputed stash and
    # its output, and the gradient. The last rank holds one stash and nothing else.
    got = memory("1f1b-r", 4, 8, chunks([1600] * 4))
    assert [m.stash for m in got] == [3 * 100 + 1700, 2 * 100 + 1700, 100 + 1700, 1600]
    assert [m.buffers for m in got] == [100, 100, 100, 0]
    assert all(m.params + m.optimizer + m.grads == 16 * 1000 for m in got)


def test_interleaved_weighs_each_chunk_by_its_own_stash():
    # p=2, v=2, m=4, rank 0 holds stages 0 and 2. Its order (warm-up 4 forwards):
    # F(s0,0) F(s0,1) F(s2,0) F(s2,1) F(s0,2) B(s2,0) F(s0,3) B(s2,1) F(s2,2) B(s0,0) ...
    # live (s0, s2) stashes peak at (3, 2) and (4, 1): max(3·100 + 2·300, 4·100 + 300) = 900;
    # the highest sample holds 900 again later, with both stages' gradients. Messages weigh
    # nothing here.
    ch = chunks([100, 200, 300, 400], params=(1, 2, 3, 4), message=[0, 0, 0, 0])
    got = memory("interleaved", 2, 4, ch)
    assert got[0].params == got[0].grads == 4 * (1 + 3)  # chunks 0 and 2
    assert got[0].stash == 900 and got[0].total == 4 * got[0].params + 900


def test_a_bf16_model_trained_at_fp32_keeps_no_master_copy():
    got = memory("1f1b", 2, 4, chunks([10, 10], param_bytes=[2000, 2000], message=[0, 0]))
    assert got[0].optimizer == 4000 and got[0].total == 2000 + 2000 + 4000 + 2 * 10


def test_bf16_training_prices_bf16_weights_fp32_grads_masters_and_state():
    ch = chunks([10, 10], message=[0, 0])  # 1000 fp32 parameters per chunk
    c = compiled("1f1b", 2, 4, ch)
    bf16 = predicted(c, ch, "cuda", "bf16")[0].peak()
    assert (bf16.params, bf16.grads, bf16.optimizer) == (2000, 4000, 12000)
    sharded = predicted(c, ch, "cuda", "bf16", zero=2)[0].peak()
    assert (sharded.params, sharded.grads, sharded.optimizer) == (2000, 4000, 6000)


def test_bf16_halves_what_activations_weigh():
    ch = chunks([1600, 1600])
    half = ch.at_bf16()
    assert half.stash_bytes == (800, 800) and half.message_bytes == (50, 0)


def test_a_cpu_plan_counts_every_receive_gloo_posts_at_the_step_start():
    # On CPU the runtime (gloo) posts a step's receives at its start: before its first
    # backward rank 0 holds all m gradient buffers, each with its host records.
    m, ch = 8, chunks([1000, 2000, 3000, 4000], params=(10, 20, 30, 40))
    cpu = memory("1f1b", 4, m, ch, "cpu")[0]
    assert (cpu.buffers, cpu.host) == (m * 125, m * GLOO_RECV_HOST.value)
    assert cpu.stash == 4 * (1000 + 125) and cpu.grads == 0


def test_the_budget_leaves_stashes_what_eviction_cannot_move():
    # Equal chunks (stash 1000, message 62). Rank 0 of 1F1B holds, besides its stashes, at
    # most its weights, gradients and AdamW state (16 000) and 5 messages: the 4 outputs kept
    # and a gradient received. A budget 3.5 stashes above that is a limit of 3.5; no other
    # rank holds more beside its stashes.
    ch = chunks([1000] * 4)
    result = compiled("1f1b", 4, 8, ch)
    samples = predicted(result, ch, "cuda")
    assert samples[0].unmovable() == 16_000 + 5 * 62
    assert max(s.unmovable() for s in samples) == samples[0].unmovable()
    layout = result.compiled.layout
    assert stash_limit(layout, ch.stash_bytes, samples, 16_310 + 3_500) == 3.5
    assert stash_limit(layout, ch.stash_bytes, samples, 10_000) == 0.0  # nothing left
    # An acceptor prices a unit by the heaviest stash it may hold: its partner's too. Rank
    # 0's stash (4000) is what rank 3 would accept, so rank 3 leaves room for fewer units.
    heavy = chunks([4000, 1000, 1000, 1000], message=[62] * 3 + [0])
    samples = predicted(compiled("1f1b", 4, 8, heavy), heavy, "cuda")
    budget = 40_000
    rank3 = (budget - samples[3].unmovable()) / 4000
    rank0 = (budget - samples[0].unmovable()) / 4000
    assert stash_limit(layout, heavy.stash_bytes, samples, budget) == min(rank0, rank3)
