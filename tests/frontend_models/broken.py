"""Small models that torch.fx cannot trace, one pitfall each, plus fixtures.

Each failing line carries a `# FAILS` marker so tests can find its line number.
"""

from dataclasses import replace

import torch
from torch import Tensor, nn

from pipec.frontend import ModelSpec


class DataDependentIf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # FAILS
            return self.lin(x)
        return x


class AssertOnShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        assert x.size(1) <= 16  # FAILS
        return self.lin(x)


class MaskBufferSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(16, 16)))

    def forward(self, x: Tensor) -> Tensor:
        t = x.size(1)
        return x @ self.mask[:t, :t]  # FAILS


class Decoder(nn.Module):
    """Blocks in a ModuleList, the shape pipec partitions; `block` is the failing module."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Identity(), block()])

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _spec(block: type[nn.Module]) -> ModelSpec:
    x = torch.randn(2, 8, 8)
    return ModelSpec(Decoder(block), (x,), torch.zeros(()), lambda out, t: out.sum())


def data_dependent_if() -> ModelSpec:
    return _spec(DataDependentIf)


def assert_on_shape() -> ModelSpec:
    return _spec(AssertOnShape)


def mask_buffer_slice() -> ModelSpec:
    return _spec(MaskBufferSlice)


class ReturnsNothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: Tensor) -> None:
        for b in self.blocks:
            x = b(x)


def returns_nothing() -> ModelSpec:
    x = torch.randn(2, 8, 8)
    return ModelSpec(ReturnsNothing(), (x,), x, lambda out, y: (out.logits - y).square().mean())


def not_a_spec() -> dict:
    return {"model": None}


def raises() -> ModelSpec:
    raise RuntimeError("out of coffee")


NOT_CALLABLE = 3


class ScaleGrad(torch.autograd.Function):
    """Identity forward, doubled gradient: a backward that a captured graph would lose."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        return 2 * grad


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return ScaleGrad.apply(self.lin(x))  # FAILS


def scale_grad(x: Tensor) -> Tensor:
    return ScaleGrad.apply(x)


# torch.fx records calls of scale_grad as one node: the Function runs, backward and all.
torch.fx.wrap("scale_grad")


class WrappedFunction(CustomFunction):
    def forward(self, x: Tensor) -> Tensor:
        return scale_grad(self.lin(x))


def custom_function() -> ModelSpec:
    return _spec(CustomFunction)


def wrapped_function() -> ModelSpec:
    return _spec(WrappedFunction)


class FourierMixer(nn.Module):
    """FNet's token mixing: the real part of a 2-D FFT, which has no bf16 kernel on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.fft.fft2(x).real)


def fourier() -> ModelSpec:
    """Trains at fp32; at bf16 its FFT cannot run (on CPU)."""
    return _spec(FourierMixer)


def fourier_fx() -> ModelSpec:
    """`fourier` captured by torch.fx, which runs no op while capturing: its FFT fails only
    when the stage runs at bf16."""
    return replace(fourier(), capture="fx")
