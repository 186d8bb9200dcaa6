"""Placeholder dispatcher (SDPA only) until the Triton kernel lands."""

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale=None
) -> torch.Tensor:
    """SDPA with grouped-query attention: k/v heads are repeated to match q's."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
