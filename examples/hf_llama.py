"""Bring a Hugging Face model: `transformers`' LlamaForCausalLM from a LlamaConfig, unmodified.

The factory builds the model from a config (random weights; load a checkpoint the usual way,
e.g. `LlamaForCausalLM.from_pretrained(path)`, to start from trained ones), draws one
micro-batch of token ids, and scores the model's output as the model returns it: a
`CausalLMOutputWithPast`, whose `logits` go into the next-token loss. pipec captures the model
with torch.export; nothing in the model is rewritten by hand.

    pipec compile examples/hf_llama.py:tiny --schedule 1f1b -p 2 -m 4 -o build/hf_llama

Any decoder of `transformers` comes in the same way: swap the config and model classes.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipec.frontend import ModelSpec, next_token_loss

# 4 layers, d=64, 4 query heads sharing 2 key/value heads (grouped-query attention).
TINY = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def make_spec(config: LlamaConfig, micro_batch: int = 2, seq_len: int = 32) -> ModelSpec:
    """A ModelSpec for `config`: the model and one random micro-batch of ids and targets."""
    model = LlamaForCausalLM(config)
    tokens = torch.randint(config.vocab_size, (micro_batch, seq_len))
    target = torch.randint(config.vocab_size, (micro_batch, seq_len))
    return ModelSpec(model, (tokens,), target, lambda out, y: next_token_loss(out.logits, y))


def tiny() -> ModelSpec:
    """4 layers, d=64, GQA: trains on a CPU in seconds."""
    return make_spec(TINY)
