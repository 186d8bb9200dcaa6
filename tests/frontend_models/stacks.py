"""Models whose blocks sit in several stacks, and models with too few or no repeated blocks.

A torchvision-style ResNet (a `stem` Sequential of conv, BN, ReLU, then `layer1..3` of residual
blocks; no torchvision import), Hugging Face T5 (encoder and decoder stacks, cross-attention),
a decoder with dropout, and models the partitioner must refuse. Random weights, nothing
downloaded.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import T5Config, T5ForConditionalGeneration

from pipec.frontend import ModelSpec, next_token_loss

VOCAB, SEQ, MB = 96, 12, 2


class ResBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs with BN, a projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """stem (conv, BN, ReLU), then layer1..3 of `depth` blocks each, pooled, a classifier."""

    def __init__(self, depth: int = 2, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        widths = [width, 2 * width, 4 * width]
        cin = width
        for k, cout in enumerate(widths, start=1):
            blocks = [ResBlock(cin if i == 0 else cout, cout, 1 if k == 1 or i else 2)
                      for i in range(depth)]  # fmt: skip
            setattr(self, f"layer{k}", nn.Sequential(*blocks))
            cin = cout
        self.fc = nn.Linear(cin, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(images))))
        return self.fc(x.mean(dim=(2, 3)))


def resnet(micro_batch_size: int = 4, depth: int = 4) -> ModelSpec:
    images = torch.randn(micro_batch_size, 3, 16, 16)
    target = torch.randint(10, (micro_batch_size,))
    return ModelSpec(ResNet(depth), (images,), target, nn.functional.cross_entropy)


def t5(dropout: float = 0.0) -> ModelSpec:
    """`transformers`' T5ForConditionalGeneration, unmodified: 4 encoder and 4 decoder blocks,
    the decoder's cross-attention reading the encoder's output; tied embedding and LM head."""
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=256,
        num_layers=4,
        num_decoder_layers=4,
        num_heads=4,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    ids = torch.randint(2, VOCAB, (MB, SEQ))
    mask = torch.ones(MB, SEQ, dtype=torch.long)
    decoder_ids = torch.randint(2, VOCAB, (MB, SEQ))
    target = torch.randint(2, VOCAB, (MB, SEQ))
    return ModelSpec(
        T5ForConditionalGeneration(config),
        (ids, mask, decoder_ids),
        target,
        lambda out, y: next_token_loss(out.logits, y),
    )


class DropoutDecoder(nn.Module):
    """Six residual MLP blocks, each with dropout 0.1 (nn.Dropout and F.dropout)."""

    def __init__(self, n_layers: int = 6, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(2 * d, d))
            for _ in range(n_layers)
        )  # fmt: skip
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = nn.functional.dropout(self.embed(tokens), 0.1, self.training)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def dropout() -> ModelSpec:
    tokens, target = torch.randint(VOCAB, (MB, SEQ)), torch.randint(VOCAB, (MB, SEQ))
    return ModelSpec(DropoutDecoder(), (tokens,), target, next_token_loss)


class StemOnly(nn.Module):
    """A conv stem and a classifier: no repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 10)

    def forward(self, images: Tensor) -> Tensor:
        return self.fc(self.stem(images).mean(dim=(2, 3)))


def stem_only() -> ModelSpec:
    images = torch.randn(MB, 3, 8, 8)
    return ModelSpec(StemOnly(), (images,), torch.randint(10, (MB,)), nn.functional.cross_entropy)
