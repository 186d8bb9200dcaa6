"""The stash: saved-tensor hooks count what the frontend measures, and an evicted stash comes
back exactly (BPipe's EVICT/LOAD move these bytes)."""

from pathlib import Path

import torch

from pipec.frontend import load_factory, measure_stash_bytes, split_model
from runtime.stash import SavedTensors, storage_key

ROOT = Path(__file__).resolve().parents[1]


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
            buffer = saved.evict()
            assert all(h.tensor is None for h in saved.handles if h.view is not None)
            assert saved.nbytes <= buffer.numel() < saved.nbytes * 1.01
            saved.restore(buffer.clone())  # as if it went to the acceptor and back
        loss.backward()
        grads.append([leaf.grad] + [p.grad for p in second.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
