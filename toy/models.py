"""Two small causal LMs of different architectures, built from a config (no download).

Sizes from TOY_STUDY's working setting: a Llama-style learner (d=128, 4 layers, about 1M parameters)
and a Qwen2-style peer (d=96, 3 layers).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

MAX_POSITIONS = 64  # prompt (<= 7 chars) + completion (<= 12 chars) + EOS, with room to spare


def build_learner(tokenizer: PreTrainedTokenizerFast, seed: int, hidden: int = 128, layers: int = 4) -> PreTrainedModel:
    """Llama-style: RMSNorm, SwiGLU, RoPE, no biases; tied embeddings."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def build_peer(tokenizer: PreTrainedTokenizerFast, seed: int, hidden: int = 96, layers: int = 3) -> PreTrainedModel:
    """Qwen2-style: biases on q/k/v, grouped-query attention; tied embeddings."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
