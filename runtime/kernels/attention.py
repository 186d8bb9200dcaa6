"""The attention dispatcher: the Triton flash kernel where it applies, SDPA everywhere else.

A model path must never fail on a shape the kernel does not take: inputs valid for SDPA but
outside the kernel (a head dim over 256, float64, seq_q != seq_k, CPU tensors without the
interpreter) run through SDPA, and the first call for each such reason says so once on stderr
as a `KernelFallback` warning. Inputs no backend could take (wrong rank, mismatched shapes,
devices or dtypes) raise ValueError before anything runs.
"""

import os
import warnings

import torch
import torch.nn.functional as F

from runtime.kernels import flash

BACKENDS = ("triton", "sdpa")


class KernelFallback(UserWarning):
    """The Triton kernel was selected but cannot take these inputs; SDPA ran instead."""


_noticed: set[str] = set()
"""Fallback reasons already announced in this process (each is announced once)."""


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
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


def _backend(q: torch.Tensor) -> str:
    """PIPEC_ATTENTION if set, else Triton for CUDA tensors and SDPA elsewhere."""
    forced = os.environ.get("PIPEC_ATTENTION", "")
    if forced and forced not in BACKENDS:
        raise ValueError(
            f"PIPEC_ATTENTION={forced!r}; expected one of {BACKENDS}, or unset "
            "(Triton on CUDA tensors, SDPA elsewhere)"
        )
    return forced or ("triton" if q.is_cuda else "sdpa")


def _notice(reason: str) -> None:
    if reason not in _noticed:
        _noticed.add(reason)
        warnings.warn(
            f"attention: the Triton kernel does not take {reason}; using SDPA for such inputs",
            KernelFallback,
            stacklevel=3,
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)` for inputs of
    shape (batch, heads, seq, head_dim), where k and v may have fewer heads than q (grouped-query
    attention: q head h uses kv head h // (q heads / kv heads)).

    Runs the Triton kernel on CUDA tensors and SDPA elsewhere; PIPEC_ATTENTION=triton|sdpa forces
    one. The kernel takes head_dim 16 to 256, fp16/bf16/fp32 and seq_q == seq_k; other inputs
    fall back to SDPA with a one-time `KernelFallback` warning.
    """
    _check_inputs(q, k, v)
    if _backend(q) == "triton":
        reason = flash.supports(q, k, v)
        if reason is None:
            scale = q.shape[3] ** -0.5 if scale is None else scale
            return flash.FlashAttention.apply(q, k, v, is_causal, scale)
        _notice(reason)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
