"""`ModelSpec.data` as the runtime reads it (runtime/data.py), and the shipped text example:
its loss falls clearly below ln 256 within the demo's steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipec.frontend import FrontendError, ModelSpec, load_factory, next_token_loss
from pipec.ir import PipecError
from pipec.runtime.data import Stream, open_source

ROOT = Path(__file__).resolve().parents[1]
X = torch.arange(8).reshape(2, 4)  # one micro-batch: 2 rows


def spec(data) -> ModelSpec:  # type: ignore[no-untyped-def]
    return ModelSpec(torch.nn.Linear(4, 4), (X,), X, next_token_loss, data=data)


def batch(k: int, rows: int = 6):
    x = torch.full((rows, 4), k)
    return x, x + 1


def test_a_batch_is_cut_into_the_micro_batches_of_every_copy():
    stream = Stream(spec(lambda rows, start: (batch(k, rows) for k in range(start, 9))), 3, 2)
    first = stream.next()
    assert len(first) == 3 and stream.position == 3
    for inputs, target in first:
        assert inputs[0].shape == (2, 4) and torch.equal(inputs[0], torch.full((2, 4), 2))
        assert torch.equal(target, inputs[0] + 1)


def test_an_iterable_repeats_and_resumes_by_skipping():
    data = [batch(k) for k in range(2)]
    stream = Stream(spec(data), 3, start=3)  # batches 0, 1, 0, [1], 0, ...
    assert [int(stream.next()[0][0][0][0, 0]) for _ in range(3)] == [1, 0, 1]


@pytest.mark.parametrize("source", ["generator", "callable", "empty list"])
def test_data_that_runs_out_says_so(source):
    data = {
        "generator": (batch(k) for k in range(1)),
        "callable": lambda rows, start: iter([batch(0, rows)]),
        "empty list": [],
    }[source]
    stream = Stream(spec(data), 3)
    if source != "empty list":
        stream.next()
    at = 0 if source == "empty list" else 1
    with pytest.raises(PipecError, match=f"ModelSpec.data ran out at batch {at}; yield batches"):
        stream.next()


@pytest.mark.parametrize(
    "bad, message",
    [
        (batch(0, rows=5), r"input 0 is \(5, 4\) torch.int64, this build needs \(6, 4\)"),
        ((X.repeat(3, 1), X.repeat(3, 1).float()), r"target is \(6, 4\) torch.float32"),
        ([X], "is a list; yield \\(inputs, target\\)"),
    ],
)
def test_a_batch_of_the_wrong_shape_is_refused_naming_what_the_build_needs(bad, message):
    with pytest.raises(PipecError, match=message):
        Stream(spec([bad]), 3).next()


def test_data_must_be_a_callable_or_an_iterable():
    with pytest.raises(FrontendError, match="ModelSpec.data must be a callable"):
        spec(3)


def test_without_data_the_batches_are_synthetic_and_the_same_every_step():
    source = open_source(spec(None), 3)
    assert source.next() is source.next()


@pytest.mark.slow
def test_the_text_example_learns_within_the_demo_s_steps():
    """The demo's run (AdamW at 3e-3, m=8 micro-batches), in one process (pipelined runs compute
    the same losses: tests/test_train.py), for 12 of its 30 steps to keep the suite short: the
    loss is already a quarter below ln 256 (the demo ends near 3.3, 0.6 of it)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ms = load_factory(f"{ROOT}/examples/text.py:shakespeare")
    opt = torch.optim.AdamW(ms.model.parameters(), lr=3e-3)
    stream = open_source(ms, 8)
    losses = []
    for _ in range(12):
        batches = stream.next()
        total = 0.0
        for inputs, target in batches:
            loss = ms.loss_fn(ms.model(*inputs), target)
            (loss / len(batches)).backward()
            total += loss.item() / len(batches)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    assert losses[0] == pytest.approx(math.log(256), rel=0.02)
    assert losses[-1] < 0.75 * math.log(256), losses
