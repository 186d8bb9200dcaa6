"""The attention op: the Triton flash kernel where it applies, SDPA everywhere else.

`attention(q, k, v, is_causal, scale)` checks its inputs and calls `torch.ops.pipec.attention`,
a torch custom op with its own backward (`pipec::attention_backward`), shapes for fake and
meta tensors, and FLOP formulas (torch's SDPA formulas). Being an op rather than Python, it
is one node whichever way a model is captured: torch.export records it (its backward with
it) instead of tracing into the kernels, `torch.fx.wrap("attention")` records the call, and
`torch.utils.flop_counter.FlopCounterMode` counts it.

Which backend runs is decided each time the op runs, on the tensors it is given: the kernel
on CUDA tensors (or wherever PIPEC_ATTENTION=triton says), SDPA elsewhere. A model path must
never fail on a shape the kernel does not take: inputs valid for SDPA but outside the kernel
(a head dim over 256, float64, seq_q != seq_k, CPU tensors without the interpreter) run
through SDPA, and the first call for each such reason says so once on stderr as a
`KernelFallback` warning. Inputs no backend could take (wrong rank, mismatched shapes,
devices or dtypes) raise ValueError before anything runs.

The op returns the output and the kernel's log-sum-exp (empty when SDPA ran): the backward
of the kernel needs it, and an op's backward sees only its inputs and outputs. SDPA's
backward is written out with the scores recomputed (as a flash backward does, and as
torch's FLOP formula counts): inside an op there is no autograd graph to differentiate.
"""

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend
from torch.utils.flop_counter import (
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from pipec.runtime.direct import DIRECT

# Triton is an extra (pip install 'pipec[gpu]'; torch's CUDA builds bring their own): without
# it every call runs SDPA, and a call that selects the kernel says so once.
try:
    import triton  # noqa: F401
except ImportError:
    flash = None
else:
    from pipec.runtime.kernels import flash

BACKENDS = ("triton", "sdpa")


class KernelFallback(UserWarning):
    """The Triton kernel was selected but cannot take these inputs; SDPA ran instead."""


_noticed: set[str] = set()
"""Fallback reasons already announced in this process (each is announced once)."""

_INTERNAL = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
"""Where the frames between a caller of `attention` and the notice live (skipped in it)."""


def _shapes(q: Tensor, k: Tensor, v: Tensor) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Checks every backend needs: the layout (batch, heads, seq, head_dim) and GQA grouping."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention: q, k, v must be 4-D (batch, heads, seq, head_dim); got {_shapes(q, k, v)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention: shapes do not match: {_shapes(q, k, v)}; k and v need the same batch, "
            "heads and seq, and q the same batch and head_dim as k"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"attention: q has {q.shape[1]} heads, k/v have {k.shape[1]} ({_shapes(q, k, v)}); "
            "q heads must be a multiple of k/v heads (grouped-query attention)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"attention: q, k, v are on {q.device}, {k.device}, {v.device}; put them on one device"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"attention: q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; use one dtype"
        )


def _backend(q: Tensor) -> str:
    """PIPEC_ATTENTION if set, else Triton for CUDA tensors and SDPA elsewhere."""
    forced = os.environ.get("PIPEC_ATTENTION", "")
    if forced and forced not in BACKENDS:
        raise ValueError(
            f"PIPEC_ATTENTION={forced!r}; expected one of {BACKENDS}, or unset "
            "(Triton on CUDA tensors, SDPA elsewhere)"
        )
    return forced or ("triton" if q.is_cuda else "sdpa")


def _kernel_runs(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the op runs these inputs on the kernel: selected, and taken (what the op's
    shapes for fake tensors need to know: the kernel also returns its log-sum-exp)."""
    return _backend(q) == "triton" and _refused(q, k, v) is None


def _refused(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the Triton kernel cannot run these inputs, or None when it can."""
    if flash is None:
        return "triton is not installed (pip install 'pipec[gpu]')"
    reason = flash.supports(q, k, v)
    return None if reason is None else f"the Triton kernel does not take {reason}"


def _notice(reason: str) -> None:
    if reason not in _noticed:
        _noticed.add(reason)
        warnings.warn(
            f"attention: {reason}; using SDPA for such inputs",
            KernelFallback,
            stacklevel=_caller_level(),
        )


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside torch and this package: the caller of
    `attention`, however many dispatcher frames lie in between."""
    frame, level = sys._getframe(1), 1  # `_notice`, whose warn counts from 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def _scale(q: Tensor, scale: float | None) -> float:
    return q.shape[3] ** -0.5 if scale is None else scale


@torch.library.custom_op("pipec::attention", mutates_args=())
def _attention(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp): the kernel's, or SDPA's output and an empty tensor."""
    return _compute(q, k, v, is_causal, scale, _kernel_forward)


def _kernel_forward(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    assert flash is not None  # `_compute` calls it only where the kernel runs
    return flash.forward(q, k, v, is_causal, scale)


def _compute(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool,
    scale: float | None,
    kernel: Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]],
) -> tuple[Tensor, Tensor]:
    """(output, log-sum-exp): `kernel` where the Triton kernel is selected and takes these
    inputs (the op calls the kernel's forward, `direct` its autograd function), else SDPA's
    output and an empty tensor."""
    if _backend(q) == "triton":
        reason = _refused(q, k, v)
        if reason is None:
            return kernel(q, k, v, is_causal, _scale(q, scale))
        _notice(reason)
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    return out, q.new_empty(0, dtype=torch.float32)


@_attention.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    # The kernel's output is contiguous; SDPA's follows its inputs' layout, which nothing
    # depends on where a captured graph runs eagerly.
    lse_shape = q.shape[:3] if _kernel_runs(q, k, v) else (0,)
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("pipec::attention_backward", mutates_args=())
def _attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV) of `pipec::attention`, by the backend its forward ran on."""
    if lse.numel():  # only the kernel returns a log-sum-exp
        assert flash is not None
        return flash.backward(do, q, k, v, o, lse, is_causal, _scale(q, scale))
    return _sdpa_backward(do, q, k, v, o, is_causal, _scale(q, scale))


@_attention_backward.register_fake
def _(do: Tensor, q: Tensor, k: Tensor, v: Tensor, *rest: object) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> bool:
    """Whether SDPA ran these fp32 CPU inputs on its flash kernel (no grouped heads)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and q.shape[1] == k.shape[1]
        and torch._fused_sdp_choice(q, k, v, is_causal=is_causal, scale=scale)
        == SDPBackend.FLASH_ATTENTION.value
    )


def _sdpa_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """SDPA's gradients. Where its forward ran the fp32 CPU flash kernel, that kernel's own
    backward (what autograd runs for SDPA, bit for bit), given the log-sum-exp the op does not
    keep: the forward recomputed by the same kernel, a quarter of the backward's time.
    Elsewhere written out, in fp32 or wider: P = softmax(scale·QKᵀ) recomputed, then
    dV = PᵀdO, dS = P∘(dO Vᵀ − rowsum(dO∘O)), dQ = scale·dS K, dK = scale·dSᵀQ, with a kv
    head's dK and dV summed over its group of q heads. Causal is SDPA's top-left mask. Like
    SDPA's math backend, it holds the (seq_q, seq_k) scores of every head while it runs."""
    if _cpu_flash(q, k, v, is_causal, scale):
        aten = torch.ops.aten
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, scale=scale
        )
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )
    group = q.shape[1] // k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    do_, q_, o_ = do.to(wide), q.to(wide), o.to(wide)
    k_, v_ = (t.to(wide).repeat_interleave(group, 1) for t in (k, v))
    scores = q_ @ k_.transpose(-2, -1) * scale
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    p = scores.softmax(-1)
    dv = p.transpose(-2, -1) @ do_
    ds = p * (do_ @ v_.transpose(-2, -1) - (do_ * o_).sum(-1, keepdim=True))
    dq = ds @ k_ * scale
    dk = ds.transpose(-2, -1) @ q_ * scale
    dk, dv = (g.unflatten(1, (-1, group)).sum(2) for g in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:  # type: ignore[no-untyped-def]
    q, k, v, ctx.is_causal, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, do: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[no-untyped-def]
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(do, q, k, v, o, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)


class _Flash(torch.autograd.Function):
    """The Triton kernel as a plain autograd function: `direct`'s path where the op would run
    the kernel. Same kernels, same log-sum-exp kept, same gradients as through the op."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float):  # type: ignore[no-untyped-def, override]
        out, lse = _kernel_forward(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[no-untyped-def, override]
        q, k, v, o, lse = ctx.saved_tensors
        assert flash is not None
        return (*flash.backward(do, q, k, v, o, lse, ctx.is_causal, ctx.scale), None, None)


def direct(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """What `torch.ops.pipec.attention` returns, (output, log-sum-exp), computed without the
    op: how a rank runs a captured stage (runtime/direct.py). The kernel through
    `_Flash` where the op would run it; elsewhere SDPA itself under autograd, whose backward
    keeps what its forward made (the fp32 CPU flash kernel's log-sum-exp: the same gradients
    as the op's, bit for bit; the math backend's probabilities). Through the op, a forward and
    backward of the tiny GPT's attention (2x4x32x16, fp32, one CPU thread) take 2.5x SDPA's
    own: two custom-op dispatches in Python, and SDPA's forward recomputed in the backward,
    since an op's backward sees only its inputs and outputs."""
    return _compute(q, k, v, is_causal, scale, _Flash.apply)


def direct_attention(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: float | None = None
) -> Tensor:
    """`attention` computed by `direct`: the output."""
    _check_inputs(q, k, v)
    return direct(q, k, v, is_causal, scale)[0]


def _broadcast_heads(kv: torch.Size, q: torch.Size) -> torch.Size:
    """k's or v's shape with q's head count: GQA's k/v heads counted as broadcast to every q
    head, which torch's SDPA formulas assume before torch 2.13 (they refuse h_kv < h_q)."""
    return torch.Size((kv[0], q[1], *kv[2:]))


@register_flop_formula(torch.ops.pipec.attention)
def _attention_flops(q, k, v, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
    return sdpa_flop_count(q, _broadcast_heads(k, q), _broadcast_heads(v, q))


@register_flop_formula(torch.ops.pipec.attention_backward)
def _attention_backward_flops(do, q, k, v, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
    return sdpa_backward_flop_count(do, q, _broadcast_heads(k, q), _broadcast_heads(v, q))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """`F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)` for inputs of
    shape (batch, heads, seq, head_dim), where k and v may have fewer heads than q (grouped-query
    attention: q head h uses kv head h // (q heads / kv heads)).

    Runs the Triton kernel on CUDA tensors and SDPA elsewhere; PIPEC_ATTENTION=triton|sdpa forces
    one. The kernel takes head_dim 16 to 256, fp16/bf16/fp32 and seq_q == seq_k; other inputs
    fall back to SDPA with a one-time `KernelFallback` warning.
    """
    _check_inputs(q, k, v)
    _backend(q)  # a bad PIPEC_ATTENTION is refused here, before the op
    return torch.ops.pipec.attention(q, k, v, is_causal, scale)[0]


# How a rank runs a captured stage's attention (runtime/direct.py): the op's node
# (torch.export) and the function's (torch.fx) call `direct`.
DIRECT.update(
    {
        torch.ops.pipec.attention.default: direct,
        torch.ops.pipec.attention: direct,
        attention: direct_attention,
    }
)
