"""Tiny models, tokenizers and a toy task for the trainer's tests and benchmark (no downloads).

A character-level tokenizer (fusing decoder) and a byte-level BPE with digits split, trained here
with `tokenizers`; Llama- and Qwen2-style causal LMs of a few hundred thousand parameters built
from a config; the task `a+b=` -> `\\boxed{a+b}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import os
import random
import uuid
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
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

from schemas import Problem, Rollout, RolloutGroup, group_advantages

TOY_CHARS = "0123456789+-=\\boxed{} "
TOY_DATASET = "toy_add"
MAX_POSITIONS = 64


def toy_completion(answer: str) -> str:
    return "\\boxed{" + answer + "}"


def toy_problems(count: int, seed: int = 0, low: int = 0, high: int = 49) -> list[Problem]:
    """`count` distinct problems `a+b=` with a, b in [low, high], in a seeded order."""
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed).shuffle(pairs)
    if count > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct problems exist in [{low}, {high}]; asked for {count}")
    return [Problem.from_text(f"{a}+{b}=", str(a + b), TOY_DATASET) for a, b in pairs[:count]]


def write_problems_jsonl(problems: list[Problem], path: Path, with_completion: bool = False) -> Path:
    """Problems as JSONL rows (id, problem, answer, source[, completion]); written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for i, p in enumerate(problems):
            row = {"id": f"{TOY_DATASET}-{i}", "problem": p.problem, "answer": p.answer, "source": TOY_DATASET}
            if with_completion:
                row["completion"] = toy_completion(p.answer)
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def build_char_tokenizer(chars: str = TOY_CHARS) -> PreTrainedTokenizerFast:
    """One token per character plus <pad>, <eos>, <unk>; the Fuse decoder joins characters without spaces."""
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)} | {c: len(specials) + i for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_bpe_tokenizer(vocab_size: int = 300, seed: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on toy completions, digits split one by one (so `\\boxed{` merges, numbers do not).

    All 256 bytes are in the vocabulary, so any text round-trips."""
    corpus = [f"{p.problem}{toy_completion(p.answer)}" for p in toy_problems(400, seed=seed)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|pad|>", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>")


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, arch: str = "llama", hidden: int = 32, layers: int = 2, seed: int = 0,
    heads: int = 4,
) -> PreTrainedModel:
    """A randomly initialised causal LM: 'llama' (RMSNorm, SwiGLU, RoPE), 'qwen2' (q/k/v biases, GQA) or
    'qwen3' (q/k norms, GQA). vLLM's CPU attention needs head_dim = hidden / heads >= 32.

    Saved to disk, prefer 'qwen3' over 'qwen2' with a locally trained tokenizer: transformers 5's
    AutoTokenizer loads any directory whose config says qwen2 as Qwen2Tokenizer, which replaces the
    saved pre-tokenizer with Qwen's regex split (a different tokenisation than the one trained)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=heads, **common))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=max(1, heads // 2), **common))
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, **common))
    raise ValueError(f"arch {arch!r}: use 'llama', 'qwen2' or 'qwen3'")


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    """save_pretrained of model and tokenizer into `path` (an HF directory load_model_and_tokenizer reads)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def supervised_finetune(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[Problem],
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
) -> PreTrainedModel:
    """A few steps of teacher forcing on `problem` -> `\\boxed{answer}` + EOS (prompt and completion
    tokenised separately, loss on the completion only), to give a tiny model partial skill."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        chosen = [problems[rng.randrange(len(problems))] for _ in range(batch_size)]
        rows, targets = [], []
        for p in chosen:
            prompt_ids = tokenizer(p.problem, add_special_tokens=False)["input_ids"]
            completion_ids = tokenizer(toy_completion(p.answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(prompt_ids + completion_ids)
            targets.append([-100] * len(prompt_ids) + completion_ids)
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])  # (B, L)
        labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])  # (B, L)
        attention = (labels != -100) | (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None])
        loss = model(input_ids=input_ids, attention_mask=attention.long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return model


def teacher_forced_logprobs(model, tokenizer, prompt: str, completion_ids: list[int]) -> list[float]:
    """log p(completion token | prompt, previous tokens) under `model`: real behaviour logprobs of a text."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # (L, V)
    logprobs = logits.log_softmax(-1)[len(prompt_ids) - 1 : -1]  # (n, V)
    return logprobs.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1).tolist()


def build_group(
    problem: Problem,
    texts: list[str],
    rewards: list[float],
    tokenizer,
    model,
    *,
    model_id: str,
    tokenizer_id: str,
    policy_step: int = 0,
    finished: bool = True,
    std_normalize: bool = True,
) -> RolloutGroup:
    """A stored-format group whose token ids and logprobs are the peer model's own (teacher-forced) ones."""
    group_id = uuid.uuid4().hex
    advantages = group_advantages(rewards, std_normalize=std_normalize)
    rollouts = []
    for i, (text, reward, advantage) in enumerate(zip(texts, rewards, advantages)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if finished else [])
        logprobs = teacher_forced_logprobs(model, tokenizer, problem.problem, ids)
        content_sum = sum(logprobs[:-1]) if finished else sum(logprobs)
        rollouts.append(Rollout(
            rollout_id=f"{group_id}-{i}", group_id=group_id, prompt_id=problem.prompt_id, dataset=problem.dataset,
            model_id=model_id, tokenizer_id=tokenizer_id, policy_step=policy_step, temperature=1.0, top_p=1.0,
            max_tokens=32, completion_text=text, completion_token_ids=ids, token_logprobs=logprobs,
            logprob_sum=content_sum, num_tokens=len(ids), num_bytes=len(text.encode()), finish_reason="stop" if finished else "length",
            reward=reward, correct=reward > 0, extracted_answer=None, advantage=advantage, group_size=len(texts),
        ))
    return RolloutGroup(rollouts=rollouts)


@dataclass
class ToyWorld:
    """A learner, a peer with another tokenizer and architecture, training problems, and a store root
    already holding the peer's groups for them."""

    learner_dir: Path  # char-level Llama, partly trained on `learner_problems`
    peer_dir: Path  # byte-level BPE Qwen3, partly trained on `peer_problems`
    problems_path: Path  # JSONL of all training problems
    anchor_path: Path  # JSONL of the learner family's problems with reference completions
    store_root: Path  # holds the peer's groups (G = peer_group_size) for every problem
    learner_problems: list[Problem]
    peer_problems: list[Problem]
    peer_model_id: str = "toy-peer"


def build_toy_world(
    root: Path, problems_per_family: int = 16, learner_sft_steps: int = 70, peer_sft_steps: int = 70,
    peer_group_size: int = 8, seed: int = 0,
) -> ToyWorld:
    """Build (in a few seconds) the toy setting used by the trainer's end-to-end tests and benchmark.

    The learner gets partial skill on its own family and none on the peer's; the peer gets partial
    skill on its family, so its stored groups there are mostly informative while the learner's
    groups there are all-fail: exactly where GRAFT grafts."""
    from rollouts.groups import assemble_group, make_group_id
    from rollouts.hf_backend import HFBackend
    from rollouts.models import model_fingerprint, tokenizer_fingerprint
    from rollouts.sampling import SamplingParams
    from rollouts.scoring import Scorer
    from services.store_api.shards import write_groups

    problems = toy_problems(2 * problems_per_family, seed=seed)
    learner_problems, peer_problems = problems[:problems_per_family], problems[problems_per_family:]
    char_tok, bpe_tok = build_char_tokenizer(), build_bpe_tokenizer(seed=seed)
    learner = supervised_finetune(build_tiny_model(char_tok, "llama", hidden=64, seed=seed + 1), char_tok, learner_problems,
                                  steps=learner_sft_steps, seed=seed)
    peer = supervised_finetune(build_tiny_model(bpe_tok, "qwen3", hidden=64, seed=seed + 2), bpe_tok, peer_problems,
                               steps=peer_sft_steps, seed=seed)
    learner_dir = save_model(learner, char_tok, root / "learner")
    peer_dir = save_model(peer, bpe_tok, root / "peer")
    problems_path = write_problems_jsonl(problems, root / "train.jsonl")
    anchor_path = write_problems_jsonl(learner_problems, root / "anchor.jsonl", with_completion=True)

    world = ToyWorld(learner_dir, peer_dir, problems_path, anchor_path, root / "store", learner_problems, peer_problems)
    backend = HFBackend(peer, bpe_tok, world.peer_model_id, batch_size=512)
    params = SamplingParams(n=peer_group_size, temperature=1.0, max_tokens=16, seed=seed)
    samples = backend.generate([p.problem for p in problems], params)
    with Scorer(num_workers=1, timeout_s=10.0) as scorer:
        scores = scorer.score([s.text for per in samples for s in per], [p.answer for p in problems for _ in range(peer_group_size)])
    revision, tokenizer_id = model_fingerprint(peer_dir), tokenizer_fingerprint(bpe_tok)
    groups = []
    for i, (problem, per_prompt) in enumerate(zip(problems, samples)):
        groups.append(assemble_group(
            problem, per_prompt, scores[i * peer_group_size : (i + 1) * peer_group_size], model_id=world.peer_model_id,
            model_revision=revision, tokenizer_id=tokenizer_id, policy_step=0, generator_id="toy-world", params=params,
            eos_token_ids=backend.eos_token_ids, group_id=make_group_id(world.peer_model_id, revision, 0, problem.prompt_id, 0),
        ))
    write_groups(world.store_root, groups, problems)
    return world
