"""A GPT-3-style decoder, small enough to read at one sitting (after nanoGPT).

Token embedding + learned positions, pre-LayerNorm blocks (causal self-attention, GELU MLP),
a final LayerNorm and an LM head, tied to the token embedding or not. No dropout: pipeline
tests compare gradients bit for bit, and dropout would need the RNG replayed per stage.

The code stays torch.fx friendly: no shape asserts, no mask buffer sliced by a traced length
(attention is causal by flag), no optional targets (the loss is `pipec.frontend.next_token_loss`).

Factories (`pipec compile examples/gpt.py:tiny`): `tiny`, `tiny_tied` and `deep` (16 narrow
layers, for 8 ranks of a V-shape) run anywhere in seconds; `gpt3_96b` builds the paper-sized
model on the meta device, good for tracing and FLOP-based cost estimates, never for running.
Each takes the micro-batch size as a keyword (`--micro-batch-size`; default: its config's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from pipec.frontend import ModelSpec, token_model_spec
from pipec.runtime.kernels import attention

# Record `attention` as one call_function node: tracing into it would hit its Python dispatch
# (GQA head check, Triton vs SDPA) and fail on a traced shape.
torch.fx.wrap("attention")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    tie_embeddings: bool = False
    micro_batch: int = 2
    dtype: torch.dtype = torch.float32


TINY = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=8)
# Deep and narrow: 16 one-layer chunks, so 8 ranks can hold a V-shape each. V-Min's rank-0
# stash is (p+4)//3 of 1F1B's p stashes at best: under 0.4x first at p=8 (3 of 8).
DEEP = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=16)
# ~16x tiny's FLOPs per micro-batch: big enough that compute, not Python, dominates a step on a
# CPU core, small enough for a benchmark of many steps (bench/compare_torch.py).
SMALL = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=8, micro_batch=4)

# GPT-3 96B as evaluated by BPipe (Kim et al., ICML 2023) and its re-evaluation (Huang et al.,
# 2024). We could not consult the papers' configuration tables offline, so the shape is chosen
# to match the name: 80 layers of hidden 9984 (78 heads of 128) give 12·L·h² + V·h ≈ 96.2B
# parameters with Megatron's padded GPT-2 vocabulary (51200) and sequence length 2048.
GPT3_96B = GPTConfig(
    vocab_size=51200,
    seq_len=2048,
    d_model=9984,
    n_heads=78,
    n_layers=80,
    tie_embeddings=True,
    micro_batch=1,
    dtype=torch.bfloat16,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.d_model = cfg.d_model
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.size()
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        q = q.view(b, t, self.n_heads, -1).transpose(1, 2)  # (b, heads, t, head_dim)
        k = k.view(b, t, self.n_heads, -1).transpose(1, 2)
        v = v.view(b, t, self.n_heads, -1).transpose(1, 2)
        y = attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # GPT-2/3 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers).
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_spec(cfg: GPTConfig, device: str = "cpu") -> ModelSpec:
    """A ModelSpec for `cfg`: the model and one random micro-batch of token ids and targets."""
    return token_model_spec(
        lambda: GPT(cfg).to(cfg.dtype), cfg.vocab_size, cfg.micro_batch, cfg.seq_len, device
    )


def tiny(micro_batch_size: int = TINY.micro_batch) -> ModelSpec:
    """8 layers, d=64: trains on a CPU in seconds."""
    return make_spec(replace(TINY, micro_batch=micro_batch_size))


def deep(micro_batch_size: int = DEEP.micro_batch) -> ModelSpec:
    """16 layers, d=32: 8 ranks of a V-shape (16 chunks) on a CPU in seconds."""
    return make_spec(replace(DEEP, micro_batch=micro_batch_size))


def small(micro_batch_size: int = SMALL.micro_batch) -> ModelSpec:
    """8 layers, d=128, micro-batch 4x64: a CPU-sized model whose steps are compute-bound."""
    return make_spec(replace(SMALL, micro_batch=micro_batch_size))


def tiny_tied(micro_batch_size: int = TINY.micro_batch) -> ModelSpec:
    """`tiny` with the LM head tied to the token embedding (first and last stage share it)."""
    return make_spec(replace(TINY, tie_embeddings=True, micro_batch=micro_batch_size))


def gpt3_96b(micro_batch_size: int = GPT3_96B.micro_batch) -> ModelSpec:
    """The paper-sized model on the meta device: traceable and costable, not runnable."""
    return make_spec(replace(GPT3_96B, micro_batch=micro_batch_size), device="meta")
