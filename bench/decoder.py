"""A small pre-norm decoder with rotary attention, as a user might write one: the held-out
model of bench/plan_check.py (no test uses it, so no test tunes pipec to it).

Token embedding (no learned positions: rotary angles carry the position), blocks of
LayerNorm -> causal self-attention with rotary queries and keys -> residual, LayerNorm ->
GELU MLP (3x wide) -> residual, a final LayerNorm and an untied head. The rotary angles are
computed from the traced sequence length in each attention, so the only tensor between two
blocks is the residual stream.

    PYTHONPATH=. python bench/plan_check.py --model bench/decoder.py:small
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipec.frontend import ModelSpec, token_model_spec
from pipec.runtime.kernels import attention

torch.fx.wrap("attention")  # one node per attention, as examples/gpt.py records it

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 512, 64, 128, 4, 8


def rotate(x: Tensor) -> Tensor:
    """x (batch, heads, seq, head_dim) rotated by position, pairs (2i, 2i+1) interleaved."""
    t, d = x.size(2), x.size(3)
    freq = 10000.0 ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class RotaryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.size()
        q, k, v = (
            y.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
            for y in self.qkv(x).chunk(3, dim=-1)
        )
        y = attention(rotate(q), rotate(k), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, WIDTH))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(WIDTH)
        self.attn = RotaryAttention()
        self.norm_mlp = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 3 * WIDTH), nn.GELU(), nn.Linear(3 * WIDTH, WIDTH)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm_attn(x))
        return x + self.mlp(self.norm_mlp(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def small(micro_batch_size: int = 4) -> ModelSpec:
    """8 layers of width 128 over 64 tokens: a step of 32 samples takes a few tenths of a
    second on one CPU core per rank."""
    return token_model_spec(Decoder, VOCAB, micro_batch_size, SEQ)
