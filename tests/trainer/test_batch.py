"""Batch assembly on real tiny models: logprob alignment, grafted rows, weights c = w * b by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from schemas import Problem
from services.generator.hf_backend import HFBackend
from services.generator.sampling import SamplingParams
from trainer.batch import TrainSample, collate, response_logprobs
from trainer.config import TrainConfig
from trainer.gate import GateDecision
from trainer.loop import Learner, _attach_old_logprobs_and_weights, _build_rows
from trainer.testing import build_group, teacher_forced_logprobs

PROBLEMS = [Problem.from_text("12+7=", "19", "toy_add"), Problem.from_text("3+4=", "7", "toy_add")]


def learner_of(model, tokenizer, tokenizer_id="tok-char"):
    return Learner(model=model, tokenizer=tokenizer, model_id="learner", tokenizer_id=tokenizer_id, revision="r",
                   eos_ids={tokenizer.eos_token_id}, device=torch.device("cpu"))


def config(**graft):
    return TrainConfig(model={"path": "unused"}, data={"dataset": "unused", "prompt_template": "raw"}, store={"url": "http://x"},
                       rollout={"max_response_tokens": 32}, graft=graft)


def test_response_logprobs_align_with_teacher_forcing_and_the_sampler(char_model, char_tokenizer):
    backend = HFBackend(char_model, char_tokenizer, "learner")
    samples = backend.generate([p.problem for p in PROBLEMS], SamplingParams(n=3, max_tokens=12, seed=0))
    rows = []
    for problem, per_prompt in zip(PROBLEMS, samples):
        prompt_ids = char_tokenizer(problem.problem, add_special_tokens=False)["input_ids"]
        for s in per_prompt:
            rows.append((TrainSample(problem.prompt_id, 0, prompt_ids, s.token_ids, len(s.token_ids), 0.0, False, 1), s))
    batch = collate([r for r, _ in rows], char_tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = response_logprobs(char_model, batch)  # (B, T)
    for b, (row, sample) in enumerate(rows):
        n = len(sample.token_ids)
        expected = teacher_forced_logprobs(char_model, char_tokenizer, PROBLEMS[b // 3].problem, sample.token_ids)
        assert logprobs[b, :n].tolist() == pytest.approx(expected, abs=1e-4)
        # pi_old on the learner's own rollouts is the sampler's behaviour distribution (T = 1, no top-p/k)
        assert logprobs[b, :n].tolist() == pytest.approx(sample.token_logprobs, abs=1e-4)
        assert logprobs[b, n:].abs().sum() == 0 and not batch.mask[b, n:].any()


def test_grafted_rows_weights_by_hand(char_model, char_tokenizer, bpe_model, bpe_tokenizer):
    problem = PROBLEMS[0]
    texts = ["\\boxed{19}", "\\boxed{18}", "\\boxed{19}", "\\boxed{1"]
    peer = build_group(problem, texts, [1.0, 0.0, 1.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    own = build_group(problem, ["1", "2", "3", "4"], [0.0, 0.0, 0.0, 0.0], char_tokenizer, char_model, model_id="learner",
                      tokenizer_id="tok-char")
    learner = learner_of(char_model, char_tokenizer)
    cfg = config(peer_negative_scale=0.5)
    counts = {}
    rows, used, drops = _build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own],
                                    {problem.prompt_id: problem}, {}, counts)
    assert used == [peer] and drops == {"round_trip": 0, "overlength": 0, "non_finite": 0}
    assert [r.grafted for r in rows] == [True] * 4 and counts["projection_uniform"] == 4  # no peer tokenizer given
    # peer-computed advantages: rewards [1, 0, 1, 0] -> +-0.866; negatives scaled by 0.5
    a = 0.5 / math.sqrt(1 / 3)
    assert [r.advantage for r in rows] == pytest.approx([a, -0.5 * a, a, -0.5 * a], rel=1e-4)
    rows, stats = _attach_old_logprobs_and_weights(cfg, learner, None, rows, drops)
    for row, rollout in zip(rows, peer.rollouts):
        old = teacher_forced_logprobs(char_model, char_tokenizer, problem.problem, row.completion_ids)
        assert row.old_logprobs.tolist() == pytest.approx(old, abs=1e-4)
        l_old = sum(old[: row.num_content_tokens])  # EOS excluded
        log_rho = max(-10.0, min(10.0, (l_old - rollout.logprob_sum) / len(rollout.completion_text.encode())))
        w = math.exp(min(0.0, log_rho))
        assert row.compat_weight == pytest.approx(w, rel=1e-4)
        b = [min(math.exp(o - mu), 2.0) for o, mu in zip(old, row.behaviour_logprobs)]
        assert row.token_weight.tolist() == pytest.approx([w * x for x in b], rel=1e-4)
    assert stats["compat_weight_mean"] == pytest.approx(sum(r.compat_weight for r in rows) / 4, rel=1e-5)
    # token_is = none: b = 1; luffy: c = 1; peer_loss_scale multiplies c (outside the spec)
    for token_is, expect_b, scale in (("none", True, 1.0), ("luffy", False, 1.0), ("none", True, 3.0), ("luffy", False, 3.0)):
        cfg = config(token_is=token_is, peer_loss_scale=scale)
        rows, _, _ = _build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own],
                                 {problem.prompt_id: problem}, {}, {})
        rows, _ = _attach_old_logprobs_and_weights(cfg, learner, None, rows, dict(drops))
        for row in rows:
            expected = scale * (row.compat_weight if expect_b else 1.0)
            assert row.token_weight.tolist() == pytest.approx([expected] * len(row.completion_ids))


def test_union_all_success_and_skipped_groups(char_model, char_tokenizer, bpe_model, bpe_tokenizer):
    problem = PROBLEMS[0]
    peer = build_group(problem, ["\\boxed{19}"] * 2, [1.0, 1.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    own = build_group(problem, ["1", "2"], [0.0, 0.0], char_tokenizer, char_model, model_id="learner", tokenizer_id="tok-char")
    learner = learner_of(char_model, char_tokenizer)
    cfg = config(union_all_success=True)
    rows, _, _ = _build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft_union", peer)], [own],
                             {problem.prompt_id: problem}, {}, {})
    # union rewards [0, 0, 1, 1]: advantages -+0.866 over learner failures (on-policy) and peer successes (grafted)
    a = 0.5 / math.sqrt(1 / 3)
    assert [(r.grafted, round(r.advantage, 4)) for r in rows] == [(False, round(-a, 4))] * 2 + [(True, round(a, 4))] * 2
    # a skipped all-fail group stays in the batch with zero advantage (as under GRPO); with
    # optim.skip_zero_advantage its rows need no forward pass
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"skip_zero_advantage": True})})
    rows, _, _ = _build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "skip_no_peer")], [own],
                             {problem.prompt_id: problem}, {}, {})
    assert [(r.grafted, r.advantage) for r in rows] == [(False, 0.0), (False, 0.0)]
    rows, _ = _attach_old_logprobs_and_weights(cfg, learner, None, rows, {"non_finite": 0})
    assert all(r.old_logprobs is None for r in rows)
