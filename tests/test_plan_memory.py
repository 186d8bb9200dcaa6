"""Per-rank memory in bytes, checked against hand computation; byte sizes as the CLI reads them."""

import pytest

from codegen.render import format_bytes
from passes.registry import Request, build_schedule, family
from pipec.compile import compile_schedule
from pipec.ir import PipecError
from pipec.plan.candidates import cost_model
from pipec.plan.facts import FBW, Chunks
from pipec.plan.memory import optimizer_bytes, parse_bytes, rank_memory


def chunks(stash, params=(1000,), param_bytes=None, inputs=None) -> Chunks:
    n = len(stash)
    params = params * n if len(params) == 1 else params
    return Chunks(
        counts=(1,) * n,
        seconds=(FBW(1.0, 1.0, 1.0),) * n,
        stash_bytes=tuple(stash),
        input_bytes=tuple(inputs or [s // 16 for s in stash]),
        params=tuple(params),
        param_bytes=tuple(param_bytes or [4 * x for x in params]),
    )


def memory(schedule, p, m, ch):
    layout = build_schedule(schedule, Request(p, m, family(schedule).default_v)).layout
    result = compile_schedule(schedule, p, m, None, cost_model(ch, layout))
    return rank_memory(result.compiled.layout, result.sim, ch)


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


def test_adamw_state_is_two_fp32_moments_plus_a_master_copy_below_fp32():
    assert optimizer_bytes(1000, 4000) == 8000  # fp32 parameters: moments only
    assert optimizer_bytes(1000, 2000) == 12000  # bf16 parameters: moments + fp32 master


def test_1f1b_rank_memory_by_hand():
    # Rank r of 1F1B stashes p - r micro-batches of its chunk; static = 4+4+8 bytes/param.
    stash = [1000, 2000, 3000, 4000]
    got = memory("1f1b", 4, 8, chunks(stash, params=(10, 20, 30, 40)))
    for r, mem in enumerate(got):
        params = 10 * (r + 1)
        assert (mem.params, mem.grads, mem.optimizer) == (4 * params, 4 * params, 8 * params)
        assert mem.stash == (4 - r) * stash[r]
        assert mem.total == 16 * params + (4 - r) * stash[r]


def test_1f1b_recompute_keeps_inputs_and_one_full_stash():
    # Rank r holds p - r - 1 stage inputs and, while recomputing, one full stash:
    # (p - r - 1) * input + stash (input = stash/16 here).
    got = memory("1f1b-r", 4, 8, chunks([1600] * 4))
    assert [m.stash for m in got] == [3 * 100 + 1600, 2 * 100 + 1600, 100 + 1600, 1600]


def test_interleaved_weighs_each_chunk_by_its_own_stash():
    # p=2, v=2, m=4, rank 0 holds stages 0 and 2. Its order (warm-up 4 forwards):
    # F(s0,0) F(s0,1) F(s2,0) F(s2,1) F(s0,2) B(s2,0) F(s0,3) B(s2,1) F(s2,2) B(s0,0) ...
    # live (s0, s2) stashes peak at (3, 2) and (4, 1): max(3·100 + 2·300, 4·100 + 300) = 900.
    got = memory("interleaved", 2, 4, chunks([100, 200, 300, 400], params=(1, 2, 3, 4)))
    assert got[0].stash == 900
    assert got[0].params == 4 * (1 + 3)  # chunks 0 and 2


def test_bf16_parameters_add_the_master_copy():
    got = memory("1f1b", 2, 4, chunks([10, 10], params=(1000,), param_bytes=[2000, 2000]))
    assert got[0].optimizer == 12000 and got[0].total == 2000 + 2000 + 12000 + 2 * 10
