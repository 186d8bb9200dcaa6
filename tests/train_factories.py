"""Factories for the training tests: a tiny GPT (tied embedding and head) whose data's targets
are its inputs (each position names its own token: learnable in a few dozen steps, and only when
every target meets the inputs of its own micro-batch), and the same model without data
(synthetic batches: random targets, which it can only memorise); a Llama of `transformers`
with its LM head tied to the embedding."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import Tensor

from examples.gpt import GPT, GPTConfig
from pipec.frontend import ModelSpec, next_token_loss

CONFIG = GPTConfig(
    vocab_size=32, seq_len=16, d_model=32, n_heads=2, n_layers=8, tie_embeddings=True
)


def _batch(rows: int, k: int) -> tuple[Tensor, Tensor]:
    x = torch.randint(CONFIG.vocab_size, (rows, CONFIG.seq_len), generator=torch.manual_seed(k))
    return x, x.clone()


def copying_data(rows: int, start: int) -> Iterator[tuple[tuple[Tensor], Tensor]]:
    """Batch k: random tokens drawn with seed k, and the same tokens as targets."""
    for k in itertools.count(start):
        x, y = _batch(rows, k)
        yield (x,), y


def copying() -> ModelSpec:
    x, y = _batch(CONFIG.micro_batch, 10**6)
    return ModelSpec(GPT(CONFIG), (x,), y, next_token_loss, data=copying_data)


def synthetic() -> ModelSpec:
    x, y = _batch(CONFIG.micro_batch, 10**6)
    return ModelSpec(GPT(CONFIG), (x,), y, next_token_loss)


def held_out(rows: int, start: int) -> Iterator[tuple[tuple[Tensor], Tensor]]:
    """Evaluation batch k: tokens from a generator of its own (seed 10**5 + k), so reading
    them draws nothing from torch's global one."""
    for k in itertools.count(start):
        gen = torch.Generator().manual_seed(10**5 + k)
        x = torch.randint(CONFIG.vocab_size, (rows, CONFIG.seq_len), generator=gen)
        yield (x,), x.clone()


def copying_with_eval() -> ModelSpec:
    """`copying`, with held-out batches for `launch.py --eval-every`."""
    x, y = _batch(CONFIG.micro_batch, 10**6)
    return ModelSpec(GPT(CONFIG), (x,), y, next_token_loss, data=copying_data, eval_data=held_out)


def _nan_at_5(logits: Tensor, target: Tensor) -> Tensor:
    """next_token_loss, NaN on an all-zero target (`nan_data` gives one at step 5)."""
    loss = next_token_loss(logits, target)
    return torch.where(target.any(), loss, torch.full_like(loss, float("nan")))


def nan_data(rows: int, start: int) -> Iterator[tuple[tuple[Tensor], Tensor]]:
    """copying_data, except that batch 4 (step 5) is all zeros."""
    for k, ((x,), y) in enumerate(copying_data(rows, start), start):
        yield (x * (k != 4),), y * (k != 4)


def nan_at_step_5() -> ModelSpec:
    """The copying GPT whose loss is NaN at step 5 (the non-finite guard's test)."""
    x, y = _batch(CONFIG.micro_batch, 10**6)
    return ModelSpec(GPT(CONFIG), (x,), y, _nan_at_5, data=nan_data)


def tied_llama() -> ModelSpec:
    """examples/hf_llama.py's tiny Llama with `tie_word_embeddings=True`: the first and last
    stages hold one parameter under two names."""
    from transformers import LlamaConfig

    from examples.hf_llama import TINY, make_spec

    return make_spec(LlamaConfig(**(TINY.to_dict() | {"tie_word_embeddings": True})))
