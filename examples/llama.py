"""A LLaMA-style decoder, small enough to read at one sitting.

RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention, untied LM head, no
biases. Rotary angles are computed inline in each attention layer from the traced sequence
length (`torch.arange` traces fine), so no table buffer is sliced by a traced size and the only
tensor between two blocks is the residual stream.

Factories: `tiny` runs anywhere in seconds; `llama_65b` builds the paper-sized model on the meta
device for tracing and FLOP-based cost estimates. Each takes the micro-batch size as a keyword
(`--micro-batch-size`; default: its config's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipec.frontend import ModelSpec, token_model_spec
from pipec.runtime.kernels import attention

# One call_function node per attention: see examples/gpt.py.
torch.fx.wrap("attention")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    micro_batch: int = 2
    dtype: torch.dtype = torch.float32


TINY = LlamaConfig(
    vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_kv_heads=2, n_layers=8, ffn_dim=176
)

# LLaMA-65B (Touvron et al., 2023, Table 2: dim 8192, 64 heads, 80 layers; SwiGLU hidden
# 2/3·4·d rounded up to a multiple of 256 = 22016; vocabulary 32000; context 2048). LLaMA-1 has
# no grouped-query attention, so kv heads = heads.
LLAMA_65B = LlamaConfig(
    vocab_size=32000,
    seq_len=2048,
    d_model=8192,
    n_heads=64,
    n_kv_heads=64,
    n_layers=80,
    ffn_dim=22016,
    micro_batch=1,
    dtype=torch.bfloat16,
)


def apply_rotary(x: Tensor, theta: float) -> Tensor:
    """Rotate x (batch, heads, seq, head_dim) by position: the "rotate half" layout."""
    t, head_dim = x.size(2), x.size(3)
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # (seq, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * angles.cos().to(x.dtype) + rotated * angles.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # Head counts from the projections' widths (-1), not the config: under tensor
        # parallelism each rank's wq/wk/wv hold a slice of the heads.
        b, t, _ = x.size()
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, self.theta), apply_rotary(k, self.theta)
        y = attention(q, k, v, is_causal=True)  # k/v heads are shared by groups of q heads
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def make_spec(cfg: LlamaConfig, device: str = "cpu") -> ModelSpec:
    """A ModelSpec for `cfg`: the model and one random micro-batch of token ids and targets."""
    return token_model_spec(
        lambda: Llama(cfg).to(cfg.dtype), cfg.vocab_size, cfg.micro_batch, cfg.seq_len, device
    )


def tiny(micro_batch_size: int = TINY.micro_batch) -> ModelSpec:
    """8 layers, d=64, 4 query heads sharing 2 kv heads: trains on a CPU in seconds."""
    return make_spec(replace(TINY, micro_batch=micro_batch_size))


def llama_65b(micro_batch_size: int = LLAMA_65B.micro_batch) -> ModelSpec:
    """The paper-sized model on the meta device: traceable and costable, not runnable."""
    return make_spec(replace(LLAMA_65B, micro_batch=micro_batch_size), device="meta")
