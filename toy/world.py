"""The tests' toy worlds, built from the toy task, tokenizers, models and warm start (no downloads).

- `build_toy_world`: a learner (character-level Llama) and a peer (byte-level BPE Qwen3) warm-started on
  disjoint halves of `SMALL` problems, and a store root holding the peer's scored groups: the trainer's
  end-to-end tests and benchmark. `build_toy_models`: the same models and problems without the groups
  (docker-compose's CPU form, `python -m toy.setup_models`).
- `cached_chat_model`: a Llama with a chat template and a BOS token, trained once per machine into the
  cache folder: the generator's and evaluation's tests (both backends, the prompt templates).
- `build_group`: a stored-format group of given texts with a model's own teacher-forced logprobs.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from graft.rollouts.files import staged_directory
from graft.rollouts.hf_backend import teacher_forced_logprobs
from graft.rollouts.models import cache_dir
from graft.rollouts.prompts import INSTRUCTION
from graft.rollouts.sampling import SamplingParams
from graft.schemas import Problem, Rollout, RolloutGroup, group_advantages
from toy.models import build_tiny_model, save_model
from toy.sft import train_quick
from toy.task import completion_text, sample_problems, write_problems_jsonl
from toy.tokenization import build_bpe_tokenizer, build_char_tokenizer

TEST_CHARS = "0123456789+-=\\boxed{} "  # the tests' learner alphabet ('-' and ' ' for hand-written texts)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def learner_tokenizer() -> PreTrainedTokenizerFast:
    """Character level over `TEST_CHARS`."""
    return build_char_tokenizer(TEST_CHARS)


def peer_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level BPE (300 tokens, every byte) trained on 400 `SMALL` problems with their completions."""
    corpus = [p.problem + completion_text(p.answer) for p in sample_problems(400, seed=seed)]
    return build_bpe_tokenizer(corpus, 300, all_bytes=True)


def warm_start(model: PreTrainedModel, tokenizer, problems: list[Problem], steps: int, seed: int = 0,
               batch_size: int = 32) -> PreTrainedModel:
    """`toy.sft.train_quick` on `problem` -> `\\boxed{answer}` + EOS, to give a tiny model partial skill."""
    return train_quick(model, tokenizer, [(p.problem, completion_text(p.answer)) for p in problems], steps,
                       batch_size=batch_size, seed=seed)


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
        prompt_ids = tokenizer(problem.problem, add_special_tokens=False)["input_ids"]
        logprobs = teacher_forced_logprobs(model, prompt_ids, [ids], SamplingParams(n=1))[0]  # temperature 1: the model's own
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


def build_toy_models(
    root: Path, problems_per_family: int = 16, learner_sft_steps: int = 70, peer_sft_steps: int = 70, seed: int = 0,
) -> ToyWorld:
    """The toy world without the peer's groups: learner/, peer/, train.jsonl and anchor.jsonl under `root`
    (`store_root` is where `build_toy_world` would put the groups; nothing is written there)."""
    return _build_models(root, problems_per_family, learner_sft_steps, peer_sft_steps, seed)[0]


def _build_models(root: Path, problems_per_family: int, learner_sft_steps: int, peer_sft_steps: int,
                  seed: int) -> tuple[ToyWorld, PreTrainedModel, PreTrainedTokenizerFast]:
    """The world's models and files, and the peer with its tokenizer in memory (to sample its groups)."""
    problems = sample_problems(2 * problems_per_family, seed=seed)
    learner_problems, peer_problems = problems[:problems_per_family], problems[problems_per_family:]
    char_tok, bpe_tok = learner_tokenizer(), peer_tokenizer(seed=seed)
    learner = warm_start(build_tiny_model(char_tok, "llama", hidden=64, seed=seed + 1), char_tok, learner_problems,
                         steps=learner_sft_steps, seed=seed)
    peer = warm_start(build_tiny_model(bpe_tok, "qwen3", hidden=64, seed=seed + 2), bpe_tok, peer_problems,
                      steps=peer_sft_steps, seed=seed)
    learner_dir = save_model(learner, char_tok, root / "learner")
    peer_dir = save_model(peer, bpe_tok, root / "peer")
    problems_path = write_problems_jsonl(problems, root / "train.jsonl")
    anchor_path = write_problems_jsonl(learner_problems, root / "anchor.jsonl", with_completion=True)
    world = ToyWorld(learner_dir, peer_dir, problems_path, anchor_path, root / "store", learner_problems, peer_problems)
    return world, peer, bpe_tok


def build_toy_world(
    root: Path, problems_per_family: int = 16, learner_sft_steps: int = 70, peer_sft_steps: int = 70,
    peer_group_size: int = 8, seed: int = 0,
) -> ToyWorld:
    """Build (in a few seconds) the toy setting used by the trainer's end-to-end tests and benchmark.

    The learner gets partial skill on its own family and none on the peer's; the peer gets partial
    skill on its family, so its stored groups there are mostly informative while the learner's
    groups there are all-fail: exactly where GRAFT grafts."""
    from graft.rollouts.groups import assemble_group, make_group_id
    from graft.rollouts.hf_backend import HFBackend
    from graft.rollouts.models import model_fingerprint, tokenizer_fingerprint
    from graft.rollouts.scoring import Scorer
    from graft.services.store_api.local import write_groups

    world, peer, bpe_tok = _build_models(root, problems_per_family, learner_sft_steps, peer_sft_steps, seed)
    problems, peer_dir = world.learner_problems + world.peer_problems, world.peer_dir
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


def cached_chat_model() -> Path:
    """A tiny Llama with a chat template and a BOS token (byte-level BPE over words, head_dim 32: the smallest
    vLLM's CPU attention supports), warm-started on `SMALL` problems so that it stops on its own and is right
    some of the time (groups with mixed rewards). Built once per machine into the cache folder, keyed by the
    toy world's source (a change to the recipe builds a new one): ~10 s on an idle machine, minutes on a busy one."""
    sources = sorted(Path(__file__).parent.glob("*.py"))
    key = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()[:12]
    target = cache_dir() / "test-models" / f"tiny-chat-llama-{key}"
    if (target / "config.json").exists():
        return target
    with staged_directory(target, replace=False) as staging:
        corpus = [p.problem + completion_text(p.answer) for p in sample_problems(2500, seed=1)]
        corpus += [f"user: assistant: {INSTRUCTION}"] * 20
        tokenizer = build_bpe_tokenizer(corpus, 320, all_bytes=True, split_words=True, bos_token="<|bos|>",
                                        chat_template=CHAT_TEMPLATE)
        model = build_tiny_model(tokenizer, "llama", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128,
                                 max_positions=256, tie_embeddings=False, seed=0)
        warm_start(model, tokenizer, sample_problems(2500, seed=2), steps=150, batch_size=64)
        save_model(model, tokenizer, staging)
    return target
