"""pipec's builds on torch's pipelining runtime with FSDP2 and tensor parallelism.

Every build is compiled here, then ONE torchrun launch of 4 gloo ranks (a 2x2 mesh, pp x
inner) runs them all (tests/torch_runtime_worker.py): pp2 x dp2 with FSDP2 (fp32 and a bf16
MixedPrecisionPolicy) and pp2 x tp2 with Colwise/RowwiseParallel, on examples/llama.py and on
Hugging Face's Llama (GQA), for the families and modes of MATRIX. One step's gradients equal a
single-process `loss.backward()` of the plain model, by parameter name (fp32, rtol 1e-5);
three steps' losses equal pipec's own runtime on the same build at pp2 x dp1 (bf16: within
bf16's precision). The bad inputs are refused in one line without a process group.
"""

from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipec.build_dir import emit
from pipec.compile import compile_schedule
from pipec.frontend import load_factory
from pipec.ir import PipecError
from pipec.model import compile_model, model_costs, model_plan
from pipec.passes.costs import CostModel
from pipec.passes.registry import Request, build_schedule, family
from pipec.torch_runtime import schedule, stage_modules
from tests.helpers import run
from tests.runtime_launch import run_cases

P, M, STEPS, LR = 2, 4, 3, 1e-3
LLAMA, HF = "examples/llama.py:tiny", "examples/hf_llama.py:tiny"
FAMILIES = ("1f1b", "interleaved", "zb-v", "v-half", "v-min")
# Every family with FSDP2 (fp32) and TP on examples/llama.py; bf16 on one looped (per-block
# FSDP) and one split-backward (per-stage FSDP) build; Hugging Face's Llama in all three
# modes on one looped and one V build. (The whole product ran once, passing; it costs about
# twice this launch.)
MATRIX = {("llama", f): ("fsdp", "tp") for f in FAMILIES}
MATRIX["llama", "interleaved"] += ("fsdp-bf16",)
MATRIX["llama", "v-min"] += ("fsdp-bf16",)
MATRIX |= {("hf_llama", f): ("fsdp", "fsdp-bf16", "tp") for f in ("interleaved", "zb-v")}
COLWISE, ROWWISE = "colwise", "rowwise"
WORKER = Path(__file__).resolve().parent / "torch_runtime_worker.py"
TP_PLANS = {
    LLAMA: {
        **{f"blocks.*.attn.{w}": COLWISE for w in ("wq", "wk", "wv")},
        "blocks.*.attn.wo": ROWWISE,
        **{f"blocks.*.ffn.{w}": COLWISE for w in ("w1", "w3")},
        "blocks.*.ffn.w2": ROWWISE,
    },
    HF: {
        **{f"model.layers.*.self_attn.{w}_proj": COLWISE for w in "qkv"},
        "model.layers.*.self_attn.o_proj": ROWWISE,
        **{f"model.layers.*.mlp.{w}_proj": COLWISE for w in ("gate", "up")},
        "model.layers.*.mlp.down_proj": ROWWISE,
    },
}


def compile_builds(tmp: Path) -> dict[str, dict]:
    """Every case's build (one frontend capture per model and stage count), by name."""
    plans: dict[tuple[str, int], dict] = {}
    cases = {}
    for (model, fam), modes in MATRIX.items():
        spec = {"llama": LLAMA, "hf_llama": HF}[model]
        v = family(fam).default_v
        layout = build_schedule(fam, Request(P, M, v, CostModel(), None)).layout
        key = (spec, layout.n_chunks)
        if key not in plans:
            plans[key] = model_plan(spec, layout, "uniform", False)  # no per-block costing
        costs = model_costs(plans[key], CostModel().of_chunks(layout.stash_share))
        name = f"{model}/{fam}"
        emit(compile_schedule(fam, P, M, v, costs, model=plans[key]), tmp / name)
        cases[name] = {"name": name, "build": str(tmp / name), "modes": list(modes)}
        cases[name] |= {"tp_plan": TP_PLANS[spec], "steps": STEPS, "lr": LR}
    # per-block FSDP units under a split backward: refused by schedule()
    cases["refused"] = cases["llama/zb-v"] | {
        "name": "refused",
        "modes": ["fsdp"],
        "per_block": True,
        "steps": 0,
    }
    # examples/fsdp_tp.py's loop (FSDP2 bf16 + TP) on the v-half build
    cases["example"] = {"name": "example", "build": cases["llama/v-half"]["build"]}
    cases["example"] |= {"example": True, "steps": 4, "lr": 3e-3}
    return cases


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("torch_runtime")
    return tmp, compile_builds(tmp)


@pytest.fixture(scope="module")
def results(compiled) -> dict[str, dict]:
    tmp, cases = compiled
    run = run_cases(list(cases.values()), 4, tmp, timeout=900, script=WORKER)
    for r in run.results:  # every rank's view must hold; rank 0's is returned
        for name, res in r.items():
            assert res["ok"], (name, res.get("error"))
    return {name: {"ranks": [r[name] for r in run.results]} for name in run.results[0]}


@pytest.mark.slow
@pytest.mark.parametrize(("model", "fam"), list(MATRIX))
def test_fsdp_and_tp_match_one_process_and_pipec(results, model, fam):
    ranks = results[f"{model}/{fam}"]["ranks"]
    pipec = ranks[0]["pipec"]
    assert len(pipec) == STEPS and all(r["pipec"] == pipec for r in ranks)
    for mode in MATRIX[model, fam]:
        for rank, r in enumerate(ranks):
            got = r[mode]
            assert "refused" not in got, got["refused"]
            tol = {"rtol": 2e-2, "atol": 0} if mode == "fsdp-bf16" else {"rtol": 1e-5, "atol": 0}
            torch.testing.assert_close(got["losses"], pipec, **tol, msg=f"{mode} rank {rank}")
            if mode != "fsdp-bf16":
                assert got["grads_checked"] > 0
                assert got["grad_errors"] == [], (mode, rank, got["grad_errors"][:3])


@pytest.mark.slow
def test_the_example_trains_with_a_falling_loss(results):
    losses = results["example"]["ranks"][0]["losses"]
    assert len(losses) == 4 and all(b < a for a, b in pairwise(losses)), losses
    assert all(r["losses"] == losses for r in results["example"]["ranks"])


@pytest.mark.slow
def test_per_block_fsdp_under_split_backward_is_refused(results):
    for r in results["refused"]["ranks"]:
        message = r["fsdp"]["refused"]
        assert "\n" not in message and "fully_shard each stage as one unit" in message


@pytest.fixture(scope="module")
def llama_build(compiled) -> Path:
    """examples/llama.py:tiny under v-half (4 stages in a V on 2 ranks)."""
    return compiled[0] / "llama/v-half"


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("fam", "kw"),
    [("1f1b", {"evict": True, "memory_limit": 3}), ("chimera", {}), ("bitpipe", {})],
)
def test_eviction_and_bidirectional_builds_are_refused(tmp_path, fam, kw):
    emit(run(fam, 4, 8, **kw), tmp_path / "b")  # refused before the model is looked at
    with pytest.raises(PipecError) as e:
        stage_modules(tmp_path / "b", load_factory(LLAMA).model, 0)
    assert "`pipec run" in _one_line(e)


def test_other_model_is_refused(llama_build):
    with pytest.raises(PipecError) as e:  # other block names
        stage_modules(llama_build, load_factory(HF).model, 0)
    assert "model.layers.0-3" in _one_line(e) and "'blocks'" in str(e.value)
    other = load_factory("examples/gpt.py:tiny").model  # same block path, other model
    with pytest.raises(PipecError) as e:
        stage_modules(llama_build, other, 0)
    assert "parameters" in _one_line(e) or "blocks" in str(e.value)


def test_pipeline_group_of_another_size_is_refused(llama_build):
    stages = [SimpleNamespace(group_size=4, group_rank=0, stage_index=0, num_stages=4)]
    with pytest.raises(PipecError) as e:
        schedule(llama_build, stages, lambda out, y: out)
    assert "make the mesh's pp dimension 2" in _one_line(e)


def test_stages_chain_to_the_model_with_its_own_names(llama_build):
    spec = load_factory(LLAMA)
    want = spec.model(*spec.example_inputs)
    stages = stage_modules(llama_build, spec.model, 0) | stage_modules(llama_build, spec.model, 1)
    assert sorted(stages) == [0, 1, 2, 3]
    names = {n for m in stages.values() for n, _ in m.named_parameters()}
    assert names == {n for n, _ in spec.model.named_parameters()}
    x = spec.example_inputs[0]
    for s in range(4):
        x = stages[s](x)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    # the stages' checks sit on the model's own blocks; the model itself still runs
    torch.testing.assert_close(spec.model(*spec.example_inputs), want, rtol=0, atol=0)


def test_code_beside_modules_before_the_blocks_is_refused(tmp_path):
    """examples/gpt.py adds position embeddings to the token embeddings: a later stage cannot
    be its own modules in a row, and says so at its first forward."""
    emit(compile_model("examples/gpt.py:tiny", "1f1b", P, M), tmp_path / "gpt")
    spec = load_factory("examples/gpt.py:tiny")
    stage = stage_modules(tmp_path / "gpt", spec.model, 1)[1]
    hidden = torch.randn(*spec.example_inputs[0].shape, spec.model.wte.embedding_dim)
    with pytest.raises(PipecError) as e:
        stage(hidden)
    assert "modules in a row" in _one_line(e)


def test_parameters_tied_across_stages_are_refused(tmp_path):
    emit(compile_model("examples/gpt.py:tiny_tied", "1f1b", P, M), tmp_path / "tied")
    with pytest.raises(PipecError) as e:
        stage_modules(tmp_path / "tied", load_factory("examples/gpt.py:tiny_tied").model, 0)
    assert "tie_word_embeddings=False" in _one_line(e)
