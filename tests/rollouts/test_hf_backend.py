"""The transformers backend on a tiny local model: valid rows, and logprobs that are the behaviour
policy's (they match a teacher-forced forward pass of the same model)."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from transformers import GenerationConfig

from graft.rollouts.groups import assemble_group, make_group_id
from graft.rollouts.hf_backend import HFBackend, processed_logprobs, teacher_forced_logprobs
from graft.rollouts.prompts import build_prompt
from graft.rollouts.sampling import SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import RolloutGroup, groups_to_table, table_to_groups
from toy.task import sample_problems

PROMPTS = ["12+7=", "3+40=", "1+1=", "44+44="]  # different lengths: rows are left-padded together


def assert_teacher_forced_match(backend: HFBackend, prompts: list[str], groups, params: SamplingParams, tol: float) -> int:
    checked = 0
    for prompt, samples in zip(prompts, groups):
        prompt_ids = backend.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for sample in samples:
            expected = teacher_forced_logprobs(backend.model, prompt_ids, [sample.token_ids], params)[0]
            assert len(expected) == len(sample.token_logprobs)
            worst = max(abs(a - b) for a, b in zip(expected, sample.token_logprobs))
            assert worst <= tol, f"logprob differs from the teacher-forced pass by {worst} (> {tol})"
            checked += len(expected)
    return checked


def test_logprobs_match_teacher_forced_pass(tiny_backend):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=0)
    groups = tiny_backend.generate(PROMPTS, params)
    assert [len(g) for g in groups] == [4] * len(PROMPTS)
    assert assert_teacher_forced_match(tiny_backend, PROMPTS, groups, params, tol=1e-4) > 50


def test_processed_logprobs_follow_temperature_top_k_top_p(tiny_backend):
    params = SamplingParams(n=4, temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, seed=1)
    groups = tiny_backend.generate(PROMPTS, params)
    assert_teacher_forced_match(tiny_backend, PROMPTS, groups, params, tol=1e-4)
    # The behaviour distribution is sharper than the model's own: most tokens gain probability.
    prompt_ids = tiny_backend.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    sample = groups[0][0]
    raw = teacher_forced_logprobs(tiny_backend.model, prompt_ids, [sample.token_ids], SamplingParams(n=1))[0]
    assert sum(sample.token_logprobs) > sum(raw)


def test_processed_logprobs_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # (1, 4)
    top_k = processed_logprobs(logits, SamplingParams(n=1, temperature=0.5, top_k=2))
    kept = torch.log_softmax(torch.tensor([4.0, 2.0]), dim=-1)
    assert torch.allclose(top_k[0, :2], kept) and torch.isinf(top_k[0, 2:]).all()
    # top_p 0.7 with probabilities ~(0.64, 0.24, 0.09, 0.03): the two largest are needed to pass 0.7.
    top_p = processed_logprobs(logits, SamplingParams(n=1, top_p=0.7))
    assert torch.allclose(top_p[0, :2], torch.log_softmax(torch.tensor([2.0, 1.0]), dim=-1)) and torch.isinf(top_p[0, 2:]).all()
    greedy = processed_logprobs(logits, SamplingParams(n=1, temperature=0.0))
    assert torch.allclose(greedy, torch.log_softmax(logits, dim=-1))


def test_finish_reasons_and_eos(tiny_backend):
    finished = tiny_backend.generate(PROMPTS, SamplingParams(n=3, max_tokens=16, seed=2))
    eos = tiny_backend.eos_token_ids
    stops = [s for g in finished for s in g if s.finish_reason == "stop"]
    assert stops, "the tiny model is trained to stop; expected some finished samples"
    for s in stops:
        assert s.token_ids[-1] in eos and not any(t in eos for t in s.token_ids[:-1])
        assert s.text == tiny_backend.tokenizer.decode(s.token_ids[:-1])  # EOS not in the text
    cut = tiny_backend.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=2, seed=2))[0]
    assert all(s.finish_reason == "length" and len(s.token_ids) == 2 for s in cut)


def test_seed_reproduces_and_batch_size_does_not_matter(tiny_model_dir, tiny_backend):
    params = SamplingParams(n=2, max_tokens=10, seed=5)
    first = tiny_backend.generate(PROMPTS, params)
    again = tiny_backend.generate(PROMPTS, params)
    assert [[s.token_ids for s in g] for g in first] == [[s.token_ids for s in g] for g in again]
    # Greedy decoding is the same in any batch composition (left padding is masked out).
    small = HFBackend(tiny_backend.model, tiny_backend.tokenizer, "tiny", batch_size=1)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    assert [[s.token_ids for s in g] for g in small.generate(PROMPTS, greedy)] == \
        [[s.token_ids for s in g] for g in tiny_backend.generate(PROMPTS, greedy)]


def test_seeds_per_sample_make_a_prompts_samples_independent_of_its_batch(tiny_backend):
    """seed_per_sample: each sample draws from its own seed (seed + (prompt_offset + i) * n + j, vLLM's request seeds),
    so a batch split into blocks (data-parallel ranks) samples what the whole batch samples, in any batch size; the
    logprobs are still the behaviour policy's. The per-call seeding draws otherwise (the switch does something)."""
    params = SamplingParams(n=3, temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, seed=9, seed_per_sample=True)
    whole = tiny_backend.generate(PROMPTS, params)
    small = HFBackend(tiny_backend.model, tiny_backend.tokenizer, "tiny", batch_size=2)
    blocks = small.generate(PROMPTS[:1], params) + small.generate(PROMPTS[1:], dataclasses.replace(params, prompt_offset=1))
    ids = [[s.token_ids for s in g] for g in whole]
    assert ids == [[s.token_ids for s in g] for g in blocks]
    assert len({tuple(t) for g in ids for t in g}) > 6  # the samples of a prompt differ from each other
    assert ids != [[s.token_ids for s in g] for g in tiny_backend.generate(PROMPTS, dataclasses.replace(params, seed_per_sample=False))]
    assert_teacher_forced_match(tiny_backend, PROMPTS, whole, params, tol=1e-4)
    with pytest.raises(ValueError, match="seed_per_sample"):
        SamplingParams(n=2, seed_per_sample=True)


def test_seeds_per_sample_draw_from_the_processed_distribution(tiny_backend):
    """The first token of 3000 samples (one seed each) against the processed distribution (T, top-k, top-p): a total
    variation within 3x what sampling noise gives on average."""
    params = SamplingParams(n=3000, temperature=3.0, top_k=12, top_p=0.95, max_tokens=1, seed=2, seed_per_sample=True)
    prompt = "3+"  # at T = 3 about ten tokens above 1% (the tiny model is sure of most answers)
    (samples,) = tiny_backend.generate([prompt], params)
    prompt_ids = torch.tensor([tiny_backend.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        probs = processed_logprobs(tiny_backend.model(input_ids=prompt_ids).logits[0, -1:], params).exp()[0]  # (V,)
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in samples]), minlength=probs.numel()).double()
    empirical = counts / counts.sum()
    assert float(empirical[probs == 0].sum()) == 0.0  # nothing outside the support
    tv = 0.5 * float((empirical - probs.double()).abs().sum())
    noise = 0.5 * float((probs.double() * (1 - probs.double()) / len(samples)).sqrt().sum())  # E|p^ - p| ~ sqrt(p(1-p)/N)
    assert int((probs > 0.01).sum()) >= 3 and tv <= 3 * noise, (tv, noise)


@pytest.mark.parametrize("cache", ["preallocated", "growing"])
@pytest.mark.parametrize("layout", ["no common prefix", "common prefix"])
def test_shared_prompt_prefill_samples_what_separate_prefills_sample(tiny_backend, layout, cache):
    # By default each prompt's tokens run through the model once: the prefix all prompts of a batch start with
    # (a system prompt, few-shot examples) once for the batch, the rest once per prompt, not once per sample;
    # the cache is then copied into a preallocated one, or kept growing when that would exceed its budget.
    assert tiny_backend.share_prompt_prefill
    shared = HFBackend(tiny_backend.model, tiny_backend.tokenizer, "tiny", static_cache_budget_bytes=0 if cache == "growing" else 1 << 30)
    separate = HFBackend(tiny_backend.model, tiny_backend.tokenizer, "tiny", share_prompt_prefill=False)
    if layout == "no common prefix":  # raw prompts (4-6 tokens) with chat prompts (75): the short rows are mostly padding
        prompts = PROMPTS + [build_prompt(tiny_backend.tokenizer, p, "chat") for p in PROMPTS[:2]]
    else:  # two worked examples in common, then problems of different lengths (padding between prefix and problem)
        prompts = [build_prompt(tiny_backend.tokenizer, p, "chat", few_shot=2) for p in PROMPTS + ["1+1+1+1+1+1="]]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=6)
    caches = []  # the type of cache each batch's generate() was handed
    prefill = shared._shared_prefill
    shared._shared_prefill = lambda *args: caches.append(prefill(*args)) or caches[-1]
    shared_groups, separate_groups = shared.generate(prompts, params), separate.generate(prompts, params)
    # a StaticCache on CPU only (HFBackend._fits_static_cache: on CUDA generate() would torch.compile each shape)
    on_cpu = tiny_backend.model.device.type == "cpu"
    assert caches and {type(c).__name__ for c in caches} == {"StaticCache" if cache == "preallocated" and on_cpu else "DynamicCache"}
    assert [[s.token_ids for s in g] for g in shared_groups] == [[s.token_ids for s in g] for g in separate_groups]
    for shared_group, separate_group in zip(shared_groups, separate_groups):
        for a, b in zip(shared_group, separate_group):
            assert max(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs)) < 1e-5
    assert_teacher_forced_match(tiny_backend, prompts, shared_groups, params, tol=1e-4)


def test_model_generation_config_and_training_mode_do_not_leak(tiny_model_dir):
    backend = HFBackend.from_path(tiny_model_dir)
    model = backend.model
    model.train()
    # A model shipping a repetition penalty and top_k=1 must not change our sampler.
    model.generation_config = GenerationConfig(repetition_penalty=5.0, top_k=1, eos_token_id=model.config.eos_token_id)
    params = SamplingParams(n=4, max_tokens=12, seed=3)
    groups = backend.generate(PROMPTS, params)
    assert model.training and model.generation_config.repetition_penalty == 5.0
    model.eval()
    assert_teacher_forced_match(backend, PROMPTS, groups, params, tol=1e-4)
    assert len({tuple(s.token_ids) for g in groups for s in g}) > len(PROMPTS), "top_k=1 leaked: samples are greedy"


def test_rows_are_valid_groups(tiny_backend, tmp_path):
    problems = sample_problems(6, seed=3, dataset="toy")
    params = SamplingParams(n=4, max_tokens=12, seed=4)
    prompts = [build_prompt(tiny_backend.tokenizer, p.problem, "raw") for p in problems]
    samples = tiny_backend.generate(prompts, params)
    with Scorer(num_workers=1) as scorer:
        scores = [scorer.score([s.text for s in g], [p.answer] * len(g)) for p, g in zip(problems, samples)]
    groups = [
        assemble_group(problem, group_samples, group_scores, model_id="tiny", model_revision="r1",
                       tokenizer_id=tiny_backend.tokenizer_id, policy_step=3, generator_id="test", params=params,
                       eos_token_ids=tiny_backend.eos_token_ids,
                       group_id=make_group_id("tiny", "r1", 3, problem.prompt_id, 0))
        for problem, group_samples, group_scores in zip(problems, samples, scores)
    ]
    round_trip = table_to_groups(groups_to_table(groups), validate=True)
    assert [g.group_id for g in round_trip] == [g.group_id for g in groups]
    for group, group_samples in zip(round_trip, samples):
        assert isinstance(group, RolloutGroup) and len(group.rollouts) == 4
        for row, sample in zip(group.rollouts, group_samples):
            assert row.completion_token_ids == sample.token_ids
            assert row.num_bytes == len(sample.text.encode())
            assert row.logprobs_mode == "processed" and row.temperature == 1.0 and row.top_k is None
            assert row.reward in (0.0, 1.0) and row.correct == (row.reward == 1.0)
            expected_sum = sum(sample.token_logprobs[:-1] if sample.finish_reason == "stop" else sample.token_logprobs)
            assert math.isclose(row.logprob_sum, expected_sum, rel_tol=1e-6, abs_tol=1e-6)
            if row.extracted_answer is not None:
                assert f"\\boxed{{{row.extracted_answer}}}" in row.completion_text


def test_group_ids_are_deterministic():
    a = make_group_id("m", "rev", 2, "0123456789abcdef", 1)
    assert a == make_group_id("m", "rev", 2, "0123456789abcdef", 1)
    others = {make_group_id("m", "rev", 2, "0123456789abcdef", 2), make_group_id("m", "rev", 3, "0123456789abcdef", 1),
              make_group_id("m", "rev2", 2, "0123456789abcdef", 1), make_group_id("m2", "rev", 2, "0123456789abcdef", 1)}
    assert a not in others and len(others) == 4


def test_prompt_templates(tiny_backend):
    tok = tiny_backend.tokenizer
    chat = build_prompt(tok, "1+1=", "auto")
    assert chat.startswith(tok.bos_token) and "1+1=" in chat and "\\boxed{}" in chat and chat.endswith("assistant: ")
    assert build_prompt(tok, "1+1=", "raw") == "1+1="
    plain = build_prompt(tok, "1+1=", "plain")
    assert plain.startswith("Question: 1+1=") and "\\boxed{}" in plain
    saved = tok.chat_template
    tok.chat_template = None
    try:
        assert build_prompt(tok, "1+1=", "auto") == plain
        with pytest.raises(ValueError, match="no chat template"):
            build_prompt(tok, "1+1=", "chat")
    finally:
        tok.chat_template = saved


def test_few_shot_prompts(tiny_backend):
    from graft.rollouts.prompts import FEW_SHOT_EXAMPLES, INSTRUCTION, MAX_FEW_SHOT
    from graft.services.generator.config import GeneratorConfig

    tok = tiny_backend.tokenizer
    assert build_prompt(tok, "1+1=", "chat", few_shot=0) == build_prompt(tok, "1+1=", "chat")  # the default is zero-shot
    chat = build_prompt(tok, "1+1=", "chat", few_shot=2)
    (q1, a1), (q2, a2), (q3, _) = FEW_SHOT_EXAMPLES[:3]
    # Earlier user/assistant turns, in order, then the problem last; every example answer ends in \boxed{}.
    assert chat.index(q1) < chat.index(a1) < chat.index(q2) < chat.index(a2) < chat.index("1+1=") and q3 not in chat
    assert chat.count(INSTRUCTION) == 3 and chat.endswith("assistant: ")
    assert all(re.search(r"The answer is \\boxed\{\d+\}\.$", a) for _, a in FEW_SHOT_EXAMPLES)
    plain = build_prompt(tok, "1+1=", "plain", few_shot=1)
    assert plain.startswith(f"Question: {q1}") and a1 in plain and plain.endswith(build_prompt(tok, "1+1=", "plain"))
    with pytest.raises(ValueError, match="raw"):
        build_prompt(tok, "1+1=", "raw", few_shot=1)
    with pytest.raises(ValueError, match=f"0 to {MAX_FEW_SHOT}"):
        build_prompt(tok, "1+1=", "chat", few_shot=MAX_FEW_SHOT + 1)
    with pytest.raises(ValueError, match="raw"):
        GeneratorConfig(model="m", dataset="d", store="s", prompt={"template": "raw", "few_shot": 2})


def test_progress_counts_tokens_within_a_call_and_changes_no_sample(tiny_backend):
    """on_tokens reports every decoding step (a CPU call can take minutes) and ends at the tokens sampled, the budget
    shrunk by the rows that stopped early; the samples are those of a call without it."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=2)
    backend = HFBackend(tiny_backend.model, tiny_backend.tokenizer, "tiny", batch_size=5)  # 12 rows: 3 calls
    plain = backend.generate(PROMPTS, params)
    reports: list[tuple[int, int]] = []
    backend.on_tokens = lambda sampled, budget: reports.append((sampled, budget))
    counted = backend.generate(PROMPTS, params)
    assert [[s.token_ids for s in g] for g in counted] == [[s.token_ids for s in g] for g in plain]
    sampled = sum(len(s.token_ids) for g in counted for s in g)
    assert reports[-1] == (sampled, sampled) and reports[0][1] == 12 * 10
    assert len(reports) > 10 and all(b >= a for a, b in reports)
