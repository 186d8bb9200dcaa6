"""A byte-level GPT that trains on real text shipped with pipec: `examples/data/shakespeare.txt`.

    pipec compile examples/text.py:shakespeare --schedule 1f1b --pp 4 -m 8 --out build/text
    torchrun --standalone --nproc-per-node 4 build/text/launch.py --steps 40 --lr 3e-3

Tokens are bytes (256 of them, no tokenizer), so an untrained model's loss is ln 256 ≈ 5.55
nats; learning which characters are common, then which follow which, takes it below 3 within
a few dozen steps. The factory gives its data as `ModelSpec.data`: batch k is `rows` windows
of the text at offsets drawn from a generator seeded by k, so any batch can be produced
directly, which is what a resumed run asks for. The text's last HELD_OUT part is not trained
on: it is `ModelSpec.eval_data`, for `launch.py --eval-every K`.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples.gpt` from any directory

from examples.gpt import GPT, GPTConfig
from pipec.frontend import ModelSpec, next_token_loss

TEXT = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
CONFIG = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=8, micro_batch=4)
HELD_OUT = 0.05  # the share of the text kept for evaluation


def text_bytes(path: Path = TEXT) -> Tensor:
    """The file's bytes as token ids (int64)."""
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def windows(tokens: Tensor, offsets: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Inputs tokens[o : o+length] and next-token targets tokens[o+1 : o+length+1] per offset."""
    index = offsets[:, None] + torch.arange(length)
    return tokens[index], tokens[index + 1]


def batches(tokens: Tensor, length: int):  # type: ignore[no-untyped-def]
    """`ModelSpec.data` for `tokens`: data(rows, start) yields batch start, start+1, …"""

    def data(rows: int, start: int) -> Iterator[tuple[tuple[Tensor], Tensor]]:
        for k in itertools.count(start):
            gen = torch.Generator().manual_seed(k)
            offsets = torch.randint(len(tokens) - length - 1, (rows,), generator=gen)
            inputs, target = windows(tokens, offsets, length)
            yield (inputs,), target

    return data


def shakespeare() -> ModelSpec:
    """8 layers, d=64, micro-batches of 4 windows of 64 bytes of Shakespeare."""
    tokens = text_bytes()
    split = int(len(tokens) * (1 - HELD_OUT))
    example, target = windows(tokens, torch.arange(CONFIG.micro_batch) * 1000, CONFIG.seq_len)
    return ModelSpec(
        GPT(CONFIG),
        (example,),
        target,
        next_token_loss,
        data=batches(tokens[:split], CONFIG.seq_len),
        eval_data=batches(tokens[split:], CONFIG.seq_len),
    )
