"""tests/capture_reuse.py, which the runtime harness's ranks use: a repeated capture gives the
same stages over new parameters of the same values, never the first capture's tensors."""

from __future__ import annotations

import pytest
import torch

from pipec.frontend import plan as frontend
from pipec.model import compile_model
from tests.capture_reuse import reusing


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["examples/gpt.py:tiny_tied", "examples/llama.py:tiny"])
def test_a_repeated_capture_has_fresh_parameters_and_the_same_stages(monkeypatch, spec, dtype):
    """Also at bf16, where the graph is captured from a cast copy and given the model's own
    values back."""
    plan = compile_model(spec, "bitpipe", 2, 4).plan["model"]
    fresh = frontend.build_stages(None, plan, [0, 1], dtype=dtype)
    calls = []
    capture = frontend._trace

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return capture(*args, **kwargs)

    monkeypatch.setattr(frontend, "_trace", reusing(counted))
    first, again = (frontend.build_stages(None, plan, [0, 1], dtype=dtype) for _ in "ab")
    assert len(calls) == 1  # the second build captured nothing
    params = [{n: p for m in ms for n, p in m.named_parameters()} for ms in (fresh, first, again)]
    assert params[0].keys() == params[2].keys()
    for name, p in params[2].items():
        assert p is not params[1][name] and torch.equal(p, params[0][name])
    tied = [{id(p) for m in ms for p in m.parameters()} for ms in (fresh, again)]
    assert len(tied[0]) == len(tied[1])  # tied weights stay one tensor
    for p in params[1].values():  # training the first build leaves the next one as built
        p.data.add_(1.0)
    assert all(torch.equal(p, params[0][n]) for n, p in params[2].items())
    assert [m.code for m in again] == [m.code for m in fresh]
