"""A tiny Llama built from a config, with a byte-level BPE tokenizer trained locally, briefly
trained on `a+b=` -> `\\boxed{a+b}<eos>` so that it stops on its own and is right some of the time
(groups with mixed rewards). Used by the generator tests; nothing is downloaded."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def toy_problems(count: int, seed: int) -> list[dict[str, str]]:
    """`count` distinct problems `a+b=` (a, b in 0-49) with their sums as gold answers."""
    pairs = [(a, b) for a in range(50) for b in range(50)]
    random.Random(seed).shuffle(pairs)
    return [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs[:count]]


def _train_tokenizer() -> PreTrainedTokenizerFast:
    corpus = [f"{p['problem']}\\boxed{{{p['answer']}}}" for p in toy_problems(2500, seed=1)]
    corpus += ["user: assistant: Please reason step by step, and put your final answer within \\boxed{}."] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[PAD, BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: Path, train_steps: int = 150, seed: int = 0) -> Path:
    """Write an HF model directory (config, safetensors, tokenizer) to `out_dir` and return it."""
    torch.manual_seed(seed)
    tokenizer = _train_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention supports
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = toy_problems(2500, seed=2)
    for step in range(train_steps):
        batch = random.Random(step).sample(train, 64)
        prompts = [tokenizer(p["problem"], add_special_tokens=False)["input_ids"] for p in batch]
        completions = [tokenizer(f"\\boxed{{{p['answer']}}}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p in batch]
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)  # (B, T) right-padded
        labels = torch.full((len(batch), width), -100)  # (B, T) loss on completion tokens only
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
        for row, (p, c) in enumerate(zip(prompts, completions)):
            ids[row, : len(p) + len(c)] = torch.tensor(p + c)
            labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
            mask[row, : len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "train_info.json").write_text(json.dumps({"steps": train_steps, "final_loss": loss.item()}))
    return out_dir


def cached_tiny_model() -> Path:
    """The tiny model, built once per machine into the cache folder (keyed by this file's contents, so a
    change to the recipe builds a new one). Building takes ~10 s on an idle machine, minutes on a busy one."""
    from rollouts.models import cache_dir

    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    target = cache_dir() / "test-models" / f"tiny-llama-{key}"
    if (target / "train_info.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_tiny_model(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "train_info.json").exists():  # not a lost race with another test process
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_toy_dataset(path: Path, count: int, seed: int = 7) -> Path:
    """A JSONL dataset of `count` toy problems (held out from the training pairs is not needed here)."""
    with open(path, "w") as f:
        for row in toy_problems(count, seed):
            f.write(json.dumps(row) + "\n")
    return path
