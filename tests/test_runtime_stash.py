"""The stash: saved-tensor hooks count what the frontend measures, an evicted stash frees its
storages for real and comes back exactly (BPipe's EVICT/LOAD move these bytes)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pipec.build_dir import emit
from pipec.frontend import load_factory, measure_stash_bytes, split_model
from pipec.ir import Op
from pipec.model import compile_model
from pipec.runtime.stash import SavedTensors, storage_key
from pipec.runtime.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:tiny"
BF16_LIMIT = 0.8 * 2**20  # bytes of stash: infeasible for fp32 stashes, not for bf16 ones


def test_hooks_count_the_frontends_stash_and_eviction_round_trips():
    spec = load_factory(f"{ROOT}/examples/gpt.py:tiny")
    first, second = split_model(spec, 2, "uniform")
    x = first(*spec.example_inputs).detach()
    grads = []
    for evict in (False, True):
        second.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        saved = SavedTensors(frozenset(storage_key(p) for p in second.parameters()))
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = spec.loss_fn(second(leaf), spec.example_target)
        assert saved.nbytes == measure_stash_bytes(
            second, (x,), lambda out: spec.loss_fn(out, spec.example_target)
        )
        if evict:
            storages = saved.storages()
            buffer = saved.evict(saved.nbytes)  # back to back: exactly the measured bytes
            assert buffer.numel() == saved.nbytes
            assert all(s.nbytes() == 0 for s in storages.values())  # freed here, for real
            with pytest.raises(RuntimeError, match="used while evicted"):
                loss.backward(retain_graph=True)
            saved.restore(buffer.clone())  # as if it went to the acceptor and back
        loss.backward()
        grads.append([leaf.grad] + [p.grad for p in second.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_eviction_refuses_a_size_the_plan_did_not_measure():
    """Both sides size the buffer from the plan; a stash of another size is a stale build."""
    t = torch.ones(8, requires_grad=True)
    saved = SavedTensors(frozenset())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        (t * t).sum()
    with pytest.raises(RuntimeError, match="the plan measured 16: .* recompile"):
        saved.evict(16)


def test_a_kept_storage_is_packed_but_not_freed():
    """Storages something else on the rank still reads (a send in flight, the batch data)
    travel in the buffer and stay here; the restore writes the same bytes back."""
    t = torch.arange(4.0, requires_grad=True)
    saved = SavedTensors(frozenset())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        y = (t * t).exp()  # saves t (twice: one storage) and y
    buffer = saved.evict(32, keep={storage_key(t)})
    assert buffer.numel() == 32
    assert t.untyped_storage().nbytes() == 16 and y.untyped_storage().nbytes() == 0
    saved.restore(buffer)
    y.sum().backward()
    torch.testing.assert_close(t.grad, 2 * t.detach() * (t.detach() ** 2).exp())


@pytest.mark.slow
def test_eviction_moves_stashes_of_the_runs_precision(tmp_path):
    """The plan measured the stashes in the model's fp32, or priced them at half for `pipec
    compile --precision bf16`; a run at another precision, or from a bf16-priced plan, measures
    its own before the first step (runtime/offload.size_moves), so an evicting build trains
    exactly as the same order without eviction, at either precision (at bf16 it failed at its
    first EVICT before: "the stash holds 265984 bytes at run time, the plan measured 529152")."""
    builds = {
        "plain": compile_model(GPT, "1f1b", 4, 8),
        "evict": compile_model(GPT, "1f1b", 4, 8, memory_limit=3, evict=True),
        "evict-bf16": compile_model(
            GPT,
            "1f1b",
            4,
            8,
            memory_limit=BF16_LIMIT,
            evict=True,
            limit_in_bytes=True,
            precision="bf16",
        ),
    }
    for name, compiled in builds.items():
        moves = sum(i.op is Op.EVICT for prog in compiled.compiled.programs for i in prog)
        assert (moves > 0) == (name != "plain")
        emit(compiled, tmp_path / name)

    def trained(name: str, precision: str) -> list[tuple[float, float]]:
        cmd, env = torchrun(tmp_path / name / "launch.py", 4, "--threads", "1")
        run = subprocess.run(
            [*cmd, "--steps", "2", "--precision", precision],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        lines = (tmp_path / name / "measured" / "metrics.jsonl").read_text().splitlines()
        return [(m["loss"], m["grad_norm"]) for m in map(json.loads, lines)]

    bf16 = trained("plain", "bf16")
    assert trained("evict", "bf16") == bf16 and trained("evict-bf16", "bf16") == bf16
    assert trained("evict-bf16", "fp32") == trained("plain", "fp32") != bf16
