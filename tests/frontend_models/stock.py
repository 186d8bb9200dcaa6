"""Models nobody on the project wrote, as their libraries ship them, from small configs.

Factories for `pipec compile` and the runtime tests: Hugging Face GPT-2, a stock
`nn.TransformerEncoder`, an `nn.Sequential` of blocks, and a ViT whose patches are embedded by
a `Conv2d` (Hugging Face Llama is examples/hf_llama.py). Random weights, nothing downloaded;
dropout off, so that gradients can be compared with a single process's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

from pipec.frontend import ModelSpec, next_token_loss

VOCAB, SEQ, MB = 128, 16, 2


def _tokens() -> tuple[Tensor, Tensor]:
    return torch.randint(VOCAB, (MB, SEQ)), torch.randint(VOCAB, (MB, SEQ))


def gpt2(n_layers: int = 4) -> ModelSpec:
    """`transformers`' GPT2LMHeadModel (Conv1D layers, tied LM head), unmodified."""
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=n_layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    tokens, target = _tokens()
    return ModelSpec(
        GPT2LMHeadModel(config), (tokens,), target, lambda out, y: next_token_loss(out.logits, y)
    )


class EncoderClassifier(nn.Module):
    """A stock nn.TransformerEncoder between an embedding and a per-token classifier."""

    def __init__(self, n_layers: int = 4, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def encoder(n_layers: int = 4) -> ModelSpec:
    tokens, target = _tokens()
    return ModelSpec(EncoderClassifier(n_layers), (tokens,), target, next_token_loss)


def sequential() -> ModelSpec:
    """An nn.Sequential of stock layers: the blocks are its children."""
    d = 32
    model = nn.Sequential(
        nn.Linear(d, d),
        *(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True) for _ in range(4)),
        nn.Linear(d, 8),
    )
    x = torch.randn(MB, SEQ, d)
    return ModelSpec(model, (x,), torch.randn(MB, SEQ, 8), nn.functional.mse_loss)


class ViT(nn.Module):
    """A small vision transformer: Conv2d patch embedding, class token, encoder layers."""

    def __init__(self, n_layers: int = 8, d: int = 64, patch: int = 4, image: int = 32) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


def vit() -> ModelSpec:
    images = torch.randn(MB, 3, 32, 32)
    return ModelSpec(ViT(), (images,), torch.randint(10, (MB,)), nn.functional.cross_entropy)


class MaskedDecoder(nn.Module):
    """Blocks that each read the model's int64 ids and bool mask: both cross every cut."""

    def __init__(self, n_layers: int = 4, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
        self.scale = nn.Embedding(VOCAB, 1)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: Tensor, keep: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x)) * self.scale(tokens) * keep.unsqueeze(-1)
        return self.head(x)


def masked() -> ModelSpec:
    tokens, target = _tokens()
    keep = torch.rand(MB, SEQ) > 0.3
    return ModelSpec(MaskedDecoder(), (tokens, keep), target, next_token_loss)
