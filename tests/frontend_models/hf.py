"""Hugging Face families nobody on the project wrote, from small configs, unmodified: the matrix
the training features are tested on (tests/test_hf_matrix.py).

Decoders with rotary positions and grouped-query attention (Qwen3, Llama with tied
embeddings), partial rotary in a parallel block (GPT-J), ALiBi (MPT), learned positions with a
tied head (GPT-2), a state-space model (Mamba), an encoder-decoder with a convolutional front
end and frozen sinusoidal positions (Whisper), and a vision model whose stages are stacks of
stacks (Swin). Random weights, nothing downloaded, dropout off.

Beyond the matrix: BERT's masked LM, dropout on (its config's default), whose head's bias is
also its decoder's, a name its graph never reads.
"""

from __future__ import annotations

import torch
import transformers as hf
from torch import Tensor

from pipec.frontend import ModelSpec, next_token_loss

VOCAB, SEQ, MB = 128, 16, 2
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128}


def _causal_lm(model: torch.nn.Module) -> ModelSpec:
    tokens = torch.randint(VOCAB, (MB, SEQ))
    target = torch.randint(VOCAB, (MB, SEQ))
    return ModelSpec(model, (tokens,), target, lambda out, y: next_token_loss(out.logits, y))


def qwen3() -> ModelSpec:
    """RoPE, GQA (4 query heads on 2 key/value heads), RMSNorm on queries and keys."""
    config = hf.Qwen3Config(
        **SMALL,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=SEQ,
    )
    return _causal_lm(hf.Qwen3ForCausalLM(config))


def llama_tied() -> ModelSpec:
    """Llama whose LM head is its embedding (`tie_word_embeddings`): one tensor, two stages."""
    config = hf.LlamaConfig(
        **SMALL,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    return _causal_lm(hf.LlamaForCausalLM(config))


def gptj() -> ModelSpec:
    """Partial rotary (8 of each head's 16 dims), attention and MLP in parallel."""
    config = hf.GPTJConfig(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=4,
        n_head=4,
        rotary_dim=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _causal_lm(hf.GPTJForCausalLM(config))


def mpt() -> ModelSpec:
    """ALiBi position biases, no position embeddings."""
    config = hf.MptConfig(
        vocab_size=VOCAB,
        d_model=64,
        n_layers=4,
        n_heads=4,
        max_seq_len=SEQ,
        attn_config={"alibi": True, "attn_pdrop": 0},
        resid_pdrop=0.0,
        emb_pdrop=0.0,
    )
    return _causal_lm(hf.MptForCausalLM(config))


def gpt2() -> ModelSpec:
    """Learned positions, Conv1D layers, the LM head tied to the embedding."""
    config = hf.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _causal_lm(hf.GPT2LMHeadModel(config))


def mamba() -> ModelSpec:
    """A selective state-space model: convolution and scan, no attention."""
    config = hf.MambaConfig(
        vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=4, expand=2
    )
    return _causal_lm(hf.MambaForCausalLM(config))


class _Whisper(torch.nn.Module):
    """Whisper's encoder-decoder; features and decoder ids in, the decoder's logits out."""

    def __init__(self, config: hf.WhisperConfig) -> None:
        super().__init__()
        self.whisper = hf.WhisperForConditionalGeneration(config)

    def forward(self, features: Tensor, ids: Tensor) -> Tensor:
        return self.whisper(input_features=features, decoder_input_ids=ids).logits


def whisper() -> ModelSpec:
    """Two convolutions, frozen sinusoidal encoder positions, 2 encoder + 2 decoder layers."""
    config = hf.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=16,
        max_target_positions=SEQ,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    features = torch.randn(MB, 16, 32)  # the conv front end halves 32 frames to 16 positions
    ids, target = torch.randint(VOCAB, (MB, SEQ)), torch.randint(VOCAB, (MB, SEQ))
    return ModelSpec(_Whisper(config), (features, ids), target, next_token_loss)


class _Swin(torch.nn.Module):
    """Swin's classifier: images in, class logits out."""

    def __init__(self, config: hf.SwinConfig) -> None:
        super().__init__()
        self.swin = hf.SwinForImageClassification(config)

    def forward(self, images: Tensor) -> Tensor:
        return self.swin(pixel_values=images).logits


def swin() -> ModelSpec:
    """Four stages of 2, 2, 6 and 2 blocks: most of the compute in the third stage."""
    config = hf.SwinConfig(
        image_size=32,
        patch_size=2,
        embed_dim=16,
        depths=[2, 2, 6, 2],
        num_heads=[1, 2, 4, 8],
        window_size=2,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    images = torch.randn(MB, 3, 32, 32)
    return ModelSpec(
        _Swin(config), (images,), torch.randint(10, (MB,)), torch.nn.functional.cross_entropy
    )


def bert() -> ModelSpec:
    """A masked LM, dropout 0.1 (the config's default): its head's bias is its decoder's, its
    decoder's weight the word embedding's."""
    config = hf.BertConfig(
        **SMALL, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=SEQ
    )
    tokens, target = torch.randint(VOCAB, (MB, SEQ)), torch.randint(VOCAB, (MB, SEQ))
    return ModelSpec(
        hf.BertForMaskedLM(config), (tokens,), target, lambda out, y: next_token_loss(out.logits, y)
    )
