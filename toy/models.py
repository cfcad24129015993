"""Small causal LMs of different architectures, built from a config (no download).

`build_tiny_model` is the one builder; `build_learner` and `build_peer` are the demo's two models, in
the setting a prototype of the toy world found to work: a Llama-style learner (d=128, 4 layers, about 1M parameters) and a
Qwen2-style peer (d=96, 3 layers).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

MAX_POSITIONS = 64  # prompt (<= 7 chars) + completion (<= 12 chars) + EOS, with room to spare


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "llama",
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    heads: int = 4,
    *,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = MAX_POSITIONS,
    tie_embeddings: bool = True,
) -> PreTrainedModel:
    """A randomly initialised causal LM (weights fixed by `seed`): 'llama' (RMSNorm, SwiGLU, RoPE, no biases),
    'qwen2' (q/k/v biases, grouped-query attention) or 'qwen3' (q/k norms, grouped-query attention).

    kv_heads: default all heads for llama, half of them for qwen; intermediate: default 2 * hidden.
    vLLM's CPU attention needs head_dim = hidden / heads >= 32. Saved to disk, prefer 'qwen3' over 'qwen2'
    with a locally trained tokenizer: transformers 5's AutoTokenizer loads any directory whose config says
    qwen2 as Qwen2Tokenizer, which replaces the saved pre-tokenizer with Qwen's regex split
    (`graft.rollouts.models.load_tokenizer` undoes that)."""
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"arch {arch!r}: use 'llama', 'qwen2' or 'qwen3'")
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads or (heads if arch == "llama" else max(1, heads // 2)),
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // heads, **common))


def build_learner(tokenizer: PreTrainedTokenizerFast, seed: int, hidden: int = 128, layers: int = 4) -> PreTrainedModel:
    """The demo's learner, Llama-style: RMSNorm, SwiGLU, RoPE, no biases; tied embeddings."""
    return build_tiny_model(tokenizer, "llama", hidden, layers, seed, heads=4, intermediate=4 * hidden)


def build_peer(tokenizer: PreTrainedTokenizerFast, seed: int, hidden: int = 96, layers: int = 3) -> PreTrainedModel:
    """The demo's peer, Qwen2-style: biases on q/k/v, grouped-query attention (2 key/value heads); tied embeddings."""
    return build_tiny_model(tokenizer, "qwen2", hidden, layers, seed, heads=4, intermediate=4 * hidden)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    """save_pretrained of model and tokenizer into `path` (an HF directory load_model_and_tokenizer reads)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
