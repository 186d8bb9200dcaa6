"""Attention kernels for the example models.

`attention(q, k, v, is_causal=False, scale=None)` has the semantics of
`torch.nn.functional.scaled_dot_product_attention` for (batch, heads, seq, head_dim) inputs,
with grouped-query attention when k/v have fewer heads than q.
"""

from pipec.runtime.kernels.attention import attention

__all__ = ["attention"]
