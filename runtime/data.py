"""Training data for the runtime: the factory's `ModelSpec.data`, or synthetic micro-batches.

A source hands out one global batch per step, already cut into the n = m·D micro-batches of the
plan (copy d of a data-parallel run takes micro-batches d·m … d·m + m − 1). Only the ranks that
hold a first stage (inputs) or a last stage (targets) ask for one: `Rank.batch` reads lazily.

- `Stream` reads the factory's data: batch k has n × (example rows) rows and is cut along its
  first dimension. Its position is the number of batches read, so a run resumed at step k
  starts at batch k: a callable is asked for `data(rows, k)`, an iterable is skipped k batches.
- `Synthetic` (no data given): every rank that needs micro-batch i, and any single-process
  reference, draws the same tensors from a generator seeded by (seed, i): integer tensors
  (token ids) uniformly from the range the example uses, floating ones from a standard normal.
  The same micro-batches come back every step, a fixed small set the model can fit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor

from pipec.frontend import ModelSpec
from pipec.ir import PipecError

MicroBatch = tuple[tuple[Tensor, ...], Tensor]


def micro_batch(spec: ModelSpec, index: int, seed: int = 0) -> MicroBatch:
    """Inputs and target of synthetic micro-batch `index` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)

    def like(example: Tensor) -> Tensor:
        if example.is_floating_point():
            return torch.randn(example.shape, generator=gen, dtype=example.dtype)
        low, high = int(example.min()), int(example.max()) + 1
        return torch.randint(low, high, example.shape, generator=gen, dtype=example.dtype)

    inputs = tuple(like(x.cpu()) for x in spec.example_inputs)
    return inputs, like(spec.example_target.cpu())


class Synthetic:
    """The same n synthetic micro-batches every step, made by the first `next`: only ranks
    that read data (first and last stages) make and hold them."""

    def __init__(self, spec: ModelSpec, n: int, seed: int) -> None:
        self.spec, self.n, self.seed = spec, n, seed
        self.batches: list[MicroBatch] | None = None

    def next(self) -> list[MicroBatch]:
        if self.batches is None:
            self.batches = [micro_batch(self.spec, i, self.seed) for i in range(self.n)]
        return self.batches


class Stream:
    """The factory's global batches (its `field`: data, or eval_data) from batch `start` on,
    each cut into n micro-batches."""

    def __init__(self, spec: ModelSpec, n: int, start: int = 0, field: str = "data") -> None:
        self.spec, self.n, self.position, self.field = spec, n, start, field
        self.rows = n * spec.example_target.shape[0]
        self._batches: Iterator | None = None  # opened by the first `next`: ranks that read

    def _open(self) -> Iterator:
        data, start = getattr(self.spec, self.field), self.position
        if callable(data):
            return iter(data(self.rows, start))
        return itertools.islice(self._cycle(data), start, None)

    def _cycle(self, data) -> Iterator:  # type: ignore[no-untyped-def]
        """An iterable over and over (epochs), until a pass yields nothing."""
        while True:
            empty = True
            for batch in data:
                empty = False
                yield batch
            if empty:
                return

    def next(self) -> list[MicroBatch]:
        if self._batches is None:
            self._batches = self._open()
        try:
            batch = next(self._batches)
        except StopIteration:
            raise PipecError(
                f"ModelSpec.{self.field} ran out at batch {self.position}; yield batches for "
                "every step (a list or other iterable is read again; a generator or iterator "
                "is not)"
            ) from None
        inputs, target = self._check(batch)
        self.position += 1
        pieces = [x.chunk(self.n) for x in inputs]
        return list(zip(zip(*pieces), target.chunk(self.n)))

    def _check(self, batch: object) -> tuple[tuple[Tensor, ...], Tensor]:
        """The batch as (inputs tuple, target), its shapes and dtypes those the plan needs."""
        where = f"ModelSpec.{self.field} batch {self.position}"
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise PipecError(f"{where} is a {type(batch).__name__}; yield (inputs, target)")
        inputs, target = batch
        inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        examples = (*self.spec.example_inputs, self.spec.example_target)
        if len(inputs) != len(self.spec.example_inputs):
            raise PipecError(
                f"{where} has {len(inputs)} inputs, the model takes "
                f"{len(self.spec.example_inputs)} (as the example)"
            )
        for k, (got, example) in enumerate(zip((*inputs, target), examples)):
            what = "target" if k == len(inputs) else f"input {k}"
            want = (self.rows, *example.shape[1:])
            if (
                not isinstance(got, Tensor)
                or tuple(got.shape) != want
                or got.dtype != example.dtype
            ):
                shown = (
                    f"{tuple(got.shape)} {got.dtype}"
                    if isinstance(got, Tensor)
                    else type(got).__name__
                )
                raise PipecError(
                    f"{where}: {what} is {shown}, this build needs {want} {example.dtype} "
                    f"({self.n} micro-batches of the example's {example.shape[0]} rows)"
                )
        return inputs, target


def open_source(spec: ModelSpec, n: int, seed: int = 0, start: int = 0) -> Synthetic | Stream:
    """The factory's data from batch `start`, or synthetic micro-batches when it gives none."""
    return Synthetic(spec, n, seed) if spec.data is None else Stream(spec, n, start)
