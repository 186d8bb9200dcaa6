"""B/W split: gradients after B then W equal a plain backward, bit for bit, per stage."""

from pathlib import Path

import pytest
import torch

from pipec.frontend import load_factory, split_model
from pipec.runtime.bwsplit import B, W, split_backward, split_linear

ROOT = Path(__file__).resolve().parents[1]
N_STAGES = 3


def build(example):
    """Two independent copies of the stages (same seed) and each stage's two micro-batches."""
    spec = load_factory(f"{ROOT}/examples/{example}.py:tiny")
    reference = split_model(spec, N_STAGES, "uniform")
    split = split_model(load_factory(f"{ROOT}/examples/{example}.py:tiny"), N_STAGES, "uniform")
    ids, target = spec.example_inputs[0], spec.example_target
    g = torch.Generator().manual_seed(1)
    micro_batches = [(ids,), (torch.randint(128, ids.shape, generator=g),)]
    targets = [target, torch.randint(128, target.shape, generator=g)]
    inputs = []  # inputs[mb][stage]
    with torch.no_grad():
        for x in micro_batches:
            per_stage = []
            for stage in reference:
                per_stage.append(x)
                x = (stage(*x),)
            inputs.append(per_stage)
    return spec, reference, split, inputs, targets


def forward(spec, stage, k, x, target, mb):
    """One F: leaves for received activations, the loss on the last stage, dY from the next."""
    leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
    out = stage(*leaves)
    if k == N_STAGES - 1:
        return leaves, spec.loss_fn(out, target), None
    g = torch.Generator().manual_seed(100 + mb)
    return leaves, out, torch.randn(out.shape, generator=g)


@pytest.mark.parametrize("example", ["gpt", "llama"])
@pytest.mark.parametrize("k", range(N_STAGES), ids=["first", "middle", "last"])
@pytest.mark.parametrize("order", ["B0 W0", "B0 B1 W1 W0"])
def test_b_then_w_equals_plain_backward(example, k, order):
    spec, reference, split, inputs, targets = build(example)
    queue = split_backward(split[k])
    assert any(n.target is split_linear for n in split[k].graph.nodes)
    mbs = sorted({int(op[1]) for op in order.split()})

    expected_input_grads = []
    for mb in mbs:
        leaves, out, dy = forward(spec, reference[k], k, inputs[mb][k], targets[mb], mb)
        torch.autograd.backward(out, dy)
        expected_input_grads.append(tuple(t.grad for t in leaves if t.requires_grad))

    pending = {mb: forward(spec, split[k], k, inputs[mb][k], targets[mb], mb) for mb in mbs}
    input_grads = {}
    for op in order.split():
        mb = int(op[1])
        if op[0] == "B":
            leaves, out, dy = pending[mb]
            input_grads[mb] = tuple(g for g in B(split[k], mb, out, dy, leaves) if g is not None)
            assert mb in queue.pending
        else:
            W(split[k], mb)
    assert queue.pending == []

    for mb in mbs:
        assert len(input_grads[mb]) == (0 if k == 0 else 1)  # token ids have no gradient
        for got, want in zip(input_grads[mb], expected_input_grads[mb]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = dict(split[k].named_parameters())
    for name, p in reference[k].named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(got[name].grad, p.grad, rtol=0, atol=0, msg=name)


def test_linear_weight_grads_wait_for_w():
    spec, _, split, inputs, targets = build("gpt")
    split_backward(split[1])
    leaves, out, dy = forward(spec, split[1], 1, inputs[0][1], targets[0], 0)
    B(split[1], 0, out, dy, leaves)
    params = dict(split[1].named_parameters())
    linear = [p for n, p in params.items() if ".ln_" not in n]
    norms = [p for n, p in params.items() if ".ln_" in n]
    assert linear and all(p.grad is None for p in linear)
    assert norms and all(p.grad is not None for p in norms)  # norm grads are computed in B
    W(split[1], 0)
    assert all(p.grad is not None for p in linear)


def test_misuse_is_reported():
    split = build("gpt")[2]
    with pytest.raises(RuntimeError, match="not prepared with split_backward"):
        W(split[1], 0)
    split_backward(split[1])
    with pytest.raises(RuntimeError, match="W for micro-batch 0 before its B"):
        W(split[1], 0)


def test_plain_backward_through_a_split_stage_still_computes_everything():
    spec, reference, split, inputs, targets = build("llama")
    split_backward(split[2])
    for stage in (reference[2], split[2]):
        _, loss, _ = forward(spec, stage, 2, inputs[0][2], targets[0], 0)
        loss.backward()
    got = dict(split[2].named_parameters())
    for name, p in reference[2].named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=0, atol=0, msg=name)
