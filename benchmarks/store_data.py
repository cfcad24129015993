"""The store benchmarks' synthetic rollouts: the models, prompts and shards they store (`plan_shards`), and the two
profiles of rollout (`ShardMaker`: `short`, 256 tokens and 1 KB of text; `reasoning`, a reasoning model's lengths
with real math text and logprobs that compress as real ones). store_bench, lookup_format_bench, browse_bench and
lake_profile write them."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from graft.schemas import ROLLOUT_ARROW_SCHEMA, prompt_id

MODELS = ("model-a", "model-b", "model-c", "model-d")
SUCCESS_RATE = {"model-a": 0.3, "model-b": 0.45, "model-c": 0.6, "model-d": 0.75}
GROUP = 8
TOKENS = 256  # the short profile: every rollout 256 tokens and 1 KB of text
TEXT_BYTES = 1024
PROFILES = ("short", "reasoning")
# the reasoning profile: token counts of a reasoning model's math answers, log-normal with a median of 1,500
# and a tail cut at max_tokens (those rollouts end with finish_reason "length"; ~0.3% of them)
REASONING_MEDIAN_TOKENS = 1500
REASONING_SIGMA = 0.65
REASONING_MAX_TOKENS = 8192
VOCAB_SIZE = 151_936  # a Qwen2.5 tokenizer's
# pre-tokenizer of the reasoning profile's corpus: words, LaTeX commands, up to 3 digits or symbols, whitespace
# (~3.2 bytes a token on the problems of data/, as a BPE tokenizer's on math text)
PIECE = re.compile(r" ?[A-Za-z]{1,10}| ?\\[A-Za-z]+| ?\d{1,3}| ?[^\sA-Za-z\d]{1,3}|\s{1,4}")


def bench_problem(i: int) -> str:
    """The text of the benchmark's i-th problem (browse_bench stores it; the shards use its prompt_id)."""
    return f"Problem {i}: what is {i} + {i + 7}?"


@functools.lru_cache(maxsize=4)
def bench_prompt_ids(prompts: int) -> np.ndarray:
    """(prompts,) prompt ids of the first `prompts` problems: hashes of their texts, as a stored problem's are
    (~60 ms for 62,500; writers make them before the clock starts)."""
    return np.array([prompt_id(bench_problem(i)) for i in range(prompts)])


@functools.lru_cache(maxsize=1)
def reasoning_corpus() -> tuple[np.ndarray, np.ndarray, bytes]:
    """The problems of data/ (~2.3 MB of English and LaTeX), cut into tokens: (token ids, each token's byte
    offset in the text, the UTF-8 text). Token ids by frequency, as BPE vocabularies number merges: a random
    sorted sample of a 151,936-token vocabulary, the most frequent piece given the smallest."""
    from graft.rollouts.datasets import data_dir

    texts: dict[str, None] = {}
    for path in sorted(data_dir().glob("*/*.jsonl")):
        for line in path.read_text().splitlines():
            texts.setdefault(json.loads(line)["problem"], None)
    pieces = PIECE.findall("\n\n".join(texts))
    kinds, inverse, counts = np.unique(np.array(pieces, dtype=object), return_inverse=True, return_counts=True)
    rank = np.empty(len(kinds), np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(len(kinds))
    vocab = np.sort(np.random.default_rng(1234).choice(VOCAB_SIZE, len(kinds), replace=False))
    ids = vocab[rank[inverse]].astype(np.int32)
    encoded = [p.encode() for p in pieces]
    offsets = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return ids, offsets, b"".join(encoded)


def reasoning_logprobs(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n,) float32 logprobs shaped like a sampled reasoning model's: most tokens near-certain, a minority
    uncertain; every value distinct, so their bytes compress as real ones do (a little), not to nothing."""
    scale = rng.choice(np.array([0.003, 0.15, 1.5]), n, p=[0.55, 0.30, 0.15])
    return (-rng.exponential(1.0, n) * scale).astype(np.float32)


class ShardMaker:
    """Synthetic shards in ROLLOUT_ARROW_SCHEMA; the bulky content and the constant columns are made once and
    reused per shard (~5 ms per 8192-rollout shard for the rest), so that generating data costs the timed
    ingest little.

    Profiles: `short`, 256 tokens and 1 KB of text a rollout (random ids, letters and logprobs: the store's
    figures since the first benchmark); `reasoning`, a reasoning model's answers: log-normal token counts
    (median 1,500, tail cut at 8,192), text that is consecutive pieces of real math problems (~3.2 bytes a
    token) with their token ids, logprobs from `reasoning_logprobs`.
    """

    def __init__(self, rows: int, seed: int, profile: str = "short"):
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        n = rows
        if profile == "short":
            ids = rng.integers(0, 50_000, n * TOKENS, dtype=np.int32)
            logprobs = -rng.exponential(0.5, n * TOKENS).astype(np.float32)
            token_offsets = np.arange(0, n * TOKENS + 1, TOKENS, dtype=np.int32)
            text = rng.integers(97, 123, n * TEXT_BYTES, dtype=np.uint8).tobytes()
            text_offsets = np.arange(0, n * TEXT_BYTES + 1, TEXT_BYTES, dtype=np.int32)
            max_tokens, finish = np.full(n, 1024, np.int32), np.array(["stop"] * n)
        elif profile == "reasoning":
            corpus_ids, piece_offsets, corpus_text = reasoning_corpus()
            wanted = np.exp(rng.normal(np.log(REASONING_MEDIAN_TOKENS), REASONING_SIGMA, n))
            counts = np.clip(wanted, 16, REASONING_MAX_TOKENS).astype(np.int64)  # (n,)
            starts = rng.integers(0, len(corpus_ids) - counts)  # each rollout a run of consecutive tokens
            ids = np.concatenate([corpus_ids[s:s + c] for s, c in zip(starts.tolist(), counts.tolist())])
            text = b"".join(corpus_text[piece_offsets[s]:piece_offsets[s + c]]
                            for s, c in zip(starts.tolist(), counts.tolist()))
            token_offsets = np.zeros(n + 1, np.int32)
            np.cumsum(counts, out=token_offsets[1:])
            text_offsets = np.zeros(n + 1, np.int32)
            np.cumsum(piece_offsets[starts + counts] - piece_offsets[starts], out=text_offsets[1:])
            logprobs = reasoning_logprobs(rng, len(ids))
            max_tokens = np.full(n, REASONING_MAX_TOKENS, np.int32)
            finish = np.where(wanted >= REASONING_MAX_TOKENS, "length", "stop")
        else:
            raise ValueError(f"profile {profile!r}: one of {PROFILES}")
        offsets = pa.array(token_offsets)
        self.token_ids = pa.ListArray.from_arrays(offsets, pa.array(ids))
        self.token_logprobs = pa.ListArray.from_arrays(offsets, pa.array(logprobs))
        # EOS excluded: the sum of all but each rollout's last logprob
        per_row = np.add.reduceat(logprobs.astype(np.float64), token_offsets[:-1]) - logprobs[token_offsets[1:] - 1]
        self.logprob_sum = pa.array(np.minimum(per_row, 0.0))
        self.text = pa.StringArray.from_buffers(n, pa.py_buffer(text_offsets.tobytes()), pa.py_buffer(text))
        self.rows = rows
        self.constant = {
            "dataset": pa.array(["synthetic"] * n), "model_revision": pa.array(["r1"] * n),
            "generator_id": pa.array(["store-bench"] * n), "schema_version": pa.array(np.ones(n, np.int32)),
            "temperature": pa.array(np.ones(n, np.float32)), "top_p": pa.array(np.ones(n, np.float32)),
            "top_k": pa.nulls(n, pa.int32()), "max_tokens": pa.array(max_tokens),
            "logprobs_mode": pa.array(["processed"] * n), "num_tokens": pa.array(np.diff(token_offsets)),
            "num_bytes": pa.array(np.diff(text_offsets)), "finish_reason": pa.array(finish),
            "extracted_answer": pa.array(["42"] * n), "group_size": pa.array(np.full(n, GROUP, np.int32)),
            "prompt_text": pa.nulls(n, pa.string()), "prompt_token_ids": pa.nulls(n, pa.list_(pa.int32())),
        }
        self.per_model: dict[str, dict[str, pa.Array]] = {}

    def shard(self, model: str, first_group: int, groups: int, prompts: int) -> pa.Table:
        """`groups` groups of `model`; its k-th group is for prompt k % prompts at policy step k // prompts."""
        n = groups * GROUP
        k = np.arange(first_group, first_group + groups)
        rewards = (self.rng.random(n) < SUCCESS_RATE.get(model, 0.5)).astype(np.float32)
        per_group = rewards.reshape(groups, GROUP).astype(np.float64)
        mean = per_group.mean(1, keepdims=True)
        std = per_group.std(1, ddof=1, keepdims=True)
        advantages = ((per_group - mean) / (std + 1e-6)).astype(np.float32).reshape(-1)
        group_ids = np.char.add(f"{model}-g", k.astype(str))
        rollout_ids = np.char.add(np.repeat(group_ids, GROUP), np.char.add("-", np.tile(np.arange(GROUP).astype(str), groups)))
        now = np.datetime64(datetime.now(timezone.utc).replace(tzinfo=None), "us")
        if model not in self.per_model:
            self.per_model[model] = {"model_id": pa.array([model] * self.rows),
                                     "tokenizer_id": pa.array([f"tok-{model}"] * self.rows)}
        columns = {name: array.slice(0, n) for name, array in (self.constant | self.per_model[model]).items()}
        columns |= {
            "rollout_id": pa.array(rollout_ids), "group_id": pa.array(np.repeat(group_ids, GROUP)),
            "prompt_id": pa.array(np.repeat(bench_prompt_ids(prompts)[k % prompts], GROUP)),
            "policy_step": pa.array(np.repeat(k // prompts, GROUP).astype(np.int64)),
            "created_at": pa.array(np.full(n, now), pa.timestamp("us", tz="UTC")),
            "completion_text": self.text.slice(0, n), "completion_token_ids": self.token_ids.slice(0, n),
            "token_logprobs": self.token_logprobs.slice(0, n), "logprob_sum": self.logprob_sum.slice(0, n),
            "reward": pa.array(rewards), "correct": pa.array(rewards > 0), "advantage": pa.array(advantages),
        }
        return pa.Table.from_arrays([columns[f.name] for f in ROLLOUT_ARROW_SCHEMA], schema=ROLLOUT_ARROW_SCHEMA)


def plan_shards(n_rollouts: int, shard_rollouts: int) -> tuple[list[tuple[str, int, int]], int]:
    """(model, first group of that model, groups) per shard, round-robin over models; and the prompt count."""
    groups_total = n_rollouts // GROUP
    per_model = groups_total // len(MODELS)
    prompts = max(1, per_model // 2)
    per_shard = max(1, shard_rollouts // GROUP)
    plan = []
    for start in range(0, per_model, per_shard):
        for model in MODELS:
            plan.append((model, start, min(per_shard, per_model - start)))
    return plan, prompts
