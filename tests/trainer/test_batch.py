"""Batch assembly on real tiny models: logprob alignment, grafted rows, weights c = w * b by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from graft.rollouts.hf_backend import HFBackend, teacher_forced_logprobs
from graft.rollouts.sampling import SamplingParams
from graft.schemas import Problem, RolloutGroup
from graft.trainer.batch import (
    PeerRowCounts,
    TrainSample,
    WeightStats,
    build_rows,
    collate,
    grafted_group_rows,
    old_logprobs_and_weights,
    response_logprobs,
)
from graft.trainer.config import TrainConfig
from graft.trainer.gate import GateDecision
from graft.trainer.learner import Learner
from graft.trainer.metrics import StepOutcome, graft_metrics, graft_tally
from graft.trainer.gate import gate_tally
from toy.world import build_group

PROBLEMS = [Problem.from_text("12+7=", "19", "toy_add"), Problem.from_text("3+4=", "7", "toy_add")]


def learner_of(model, tokenizer, tokenizer_id="tok-char"):
    return Learner(hf_model=model, tokenizer=tokenizer, model_id="learner", tokenizer_id=tokenizer_id, revision="r",
                   eos_ids={tokenizer.eos_token_id}, device=torch.device("cpu"))


def forced(model, tokenizer, prompt: str, completion_ids: list[int]) -> list[float]:
    """The model's own (temperature 1) logprobs of `completion_ids` after `prompt`, from one forward pass."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return teacher_forced_logprobs(model, prompt_ids, [completion_ids], SamplingParams(n=1))[0]


def config(**graft):
    """These cases are the `spec` preset's formulas (b, peer negatives) unless they say otherwise."""
    graft = {"token_is": "tis", "peer_negative_scale": 1.0, **graft}
    return TrainConfig(model={"path": "unused"}, data={"dataset": "unused"}, prompt={"template": "raw"}, store={"url": "http://x"},
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
        expected = forced(char_model, char_tokenizer, PROBLEMS[b // 3].problem, sample.token_ids)
        assert logprobs[b, :n].tolist() == pytest.approx(expected, abs=1e-4)
        # pi_old on the learner's own rollouts is the sampler's behaviour distribution (T = 1, no top-p/k)
        assert logprobs[b, :n].tolist() == pytest.approx(sample.token_logprobs, abs=1e-4)
        assert logprobs[b, n:].abs().sum() == 0 and not batch.mask[b, n:].any()


def grafting(char_model, char_tokenizer, bpe_model, bpe_tokenizer):
    """A BPE peer's informative group for the char learner's all-fail one: (problem, peer group, learner, build),
    where build(cfg) runs `build_rows` on the grafting decision."""
    problem = PROBLEMS[0]
    texts = ["\\boxed{19}", "\\boxed{18}", "\\boxed{19}", "\\boxed{1"]
    peer = build_group(problem, texts, [1.0, 0.0, 1.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    own = build_group(problem, ["1", "2", "3", "4"], [0.0, 0.0, 0.0, 0.0], char_tokenizer, char_model, model_id="learner",
                      tokenizer_id="tok-char")
    learner = learner_of(char_model, char_tokenizer)

    def build(cfg):
        return build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own],
                          {problem.prompt_id: problem}, {"tok-bpe": bpe_tokenizer})

    return problem, peer, learner, build


def test_grafted_rows_weights_by_hand(char_model, char_tokenizer, bpe_model, bpe_tokenizer):
    problem, peer, learner, build = grafting(char_model, char_tokenizer, bpe_model, bpe_tokenizer)
    cfg = config(peer_negative_scale=0.5)
    step_rows = build(cfg)
    rows = step_rows.rows
    assert step_rows.peer_groups_used == [peer] and sum(step_rows.counts.drops.values()) == 0
    assert [r.grafted for r in rows] == [True] * 4 and step_rows.counts.projections["spans"] == 4
    # peer-computed advantages: rewards [1, 0, 1, 0] -> +-0.866; negatives scaled by 0.5
    a = 0.5 / math.sqrt(1 / 3)
    assert [r.advantage for r in rows] == pytest.approx([a, -0.5 * a, a, -0.5 * a], rel=1e-4)
    weighted = old_logprobs_and_weights(cfg, learner, None, rows)
    rows = weighted.rows
    assert weighted.dropped_non_finite == 0
    for row, rollout in zip(rows, peer.rollouts):
        old = forced(char_model, char_tokenizer, problem.problem, row.completion_ids)
        assert row.old_logprobs.tolist() == pytest.approx(old, abs=1e-4)
        l_old = sum(old[: row.num_content_tokens])  # EOS excluded
        log_rho = max(-10.0, min(10.0, (l_old - rollout.logprob_sum) / len(rollout.completion_text.encode())))
        w = math.exp(min(0.0, log_rho))
        assert row.compat_weight == pytest.approx(w, rel=1e-4)
        b = [min(math.exp(o - mu), 2.0) for o, mu in zip(old, row.behaviour_logprobs)]
        assert row.token_weight.tolist() == pytest.approx([w * x for x in b], rel=1e-4)
    assert weighted.stats.compat_weight_mean == pytest.approx(sum(r.compat_weight for r in rows) / 4, rel=1e-5)


def test_a_grafted_group_that_lost_a_row_gets_advantages_over_the_rows_that_train(char_model, char_tokenizer, bpe_model,
                                                                                  bpe_tokenizer):
    """The peer's stored advantages are over its whole group; a row dropped by re-tokenisation (here: longer than
    the learner's 32 tokens) would leave the rest summing to 0.866, a net push on every token they share. They are
    recomputed over the kept rows, and the step counts the group."""
    problem = PROBLEMS[0]
    texts = ["\\boxed{19}", "\\boxed{18}", "\\boxed{19}", "\\boxed{" + "1" * 40 + "}"]
    peer = build_group(problem, texts, [1.0, 0.0, 1.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    own = build_group(problem, ["1", "2", "3", "4"], [0.0] * 4, char_tokenizer, char_model, model_id="learner",
                      tokenizer_id="tok-char")
    step_rows = build_rows(config(), learner_of(char_model, char_tokenizer),
                           [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own], {problem.prompt_id: problem},
                           {"tok-bpe": bpe_tokenizer})
    assert step_rows.counts.drops["overlength"] == 1 and step_rows.counts.grafted_groups_short == 1 and step_rows.counts.peer_samples == 4
    assert step_rows.counts.peer_advantage_mismatch == 0  # the stored group's advantages were right; only the rows changed
    # rewards [1, 0, 1] kept: mean 2/3, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    assert [r.advantage for r in step_rows.rows] == pytest.approx([(1 / 3) / std, -(2 / 3) / std, (1 / 3) / std], rel=1e-4)
    assert sum(r.advantage for r in step_rows.rows) == pytest.approx(0.0, abs=1e-6)


def test_a_peer_group_larger_than_a_hosts_slots_keeps_a_success_and_a_failure(char_model, char_tokenizer, bpe_model,
                                                                             bpe_tokenizer):
    """A host with G slots per group (TRL's num_generations, verl's rollout.n) and a peer group of 8 whose only
    success is its last row: its first 4 rows would all fail (advantages 0: grafted for nothing). The pick keeps
    the success and a failure, is the same for the same seed, and is counted."""
    problem = PROBLEMS[0]
    texts = ["\\boxed{18}"] * 7 + ["\\boxed{19}"]
    peer = build_group(problem, texts, [0.0] * 7 + [1.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    learner = learner_of(char_model, char_tokenizer)

    def pick(seed: int) -> tuple[list[TrainSample], PeerRowCounts]:
        counts = PeerRowCounts()
        rows = grafted_group_rows(config(), learner, peer, 0, [1, 2], {"tok-bpe": bpe_tokenizer}, None, counts,
                                  max_rows=4, pick_seed=seed)
        return rows, counts

    rows, counts = pick(0)
    assert len(rows) == 4 and sorted(row.reward for row in rows) == [0.0, 0.0, 0.0, 1.0]
    assert max(row.advantage for row in rows) > 0 and sum(row.advantage for row in rows) == pytest.approx(0, abs=1e-6)
    assert (counts.grafted_groups_subsampled, counts.grafted_groups_short, counts.grafted_groups_no_signal) == (1, 1, 0)
    assert [row.completion_ids for row in pick(0)[0]] == [row.completion_ids for row in rows]  # seeded
    two = build_group(problem, ["\\boxed{18}", "\\boxed{19}"] * 4, [0.0, 1.0] * 4, bpe_tokenizer, bpe_model,
                      model_id="peer", tokenizer_id="tok-bpe")
    for seed in range(8):  # two slots: always one of each reward
        counts = PeerRowCounts()
        kept = grafted_group_rows(config(), learner, two, 0, [1, 2], {"tok-bpe": bpe_tokenizer}, None, counts,
                                  max_rows=2, pick_seed=seed)
        assert sorted(row.reward for row in kept) == [0.0, 1.0]
    counts = PeerRowCounts()
    lone = build_group(problem, ["\\boxed{18}"] * 3, [0.0] * 3, bpe_tokenizer, bpe_model, model_id="peer",
                       tokenizer_id="tok-bpe")
    grafted_group_rows(config(), learner, lone, 0, [1, 2], {"tok-bpe": bpe_tokenizer}, None, counts, max_rows=2)
    assert counts.grafted_groups_no_signal == 1  # one reward among the rows that train: counted, not hidden


def test_group_normalized_weight_leaves_no_net_push_on_the_tokens_a_group_shares(char_model, char_tokenizer, bpe_model,
                                                                                  bpe_tokenizer):
    """Every row of the group starts with the same characters, where pi_old and mu~ (so b) are the same: the grafted
    rows' per-token weights c times their advantages must sum to zero there, as a GRPO group's advantages do."""
    _, _, learner, build = grafting(char_model, char_tokenizer, bpe_model, bpe_tokenizer)

    def first_token_push(cfg) -> tuple[float, list[float]]:
        rows = old_logprobs_and_weights(cfg, learner, None, build(cfg).rows).rows
        return sum(float(r.token_weight[0]) * r.advantage for r in rows), [r.compat_weight for r in rows]

    plain, weights = first_token_push(config())
    assert max(weights) - min(weights) > 0.05 and abs(plain) > 1e-3  # unequal w: plain GRAFT pushes the shared token
    centred, _ = first_token_push(config(group_normalized_weight=True))
    assert centred == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="peer_negative_scale"):
        config(group_normalized_weight=True, peer_negative_scale=0.0)


def test_token_is_none_and_luffy_keep_the_sequence_weight(char_model, char_tokenizer, bpe_model, bpe_tokenizer):
    _, _, learner, build = grafting(char_model, char_tokenizer, bpe_model, bpe_tokenizer)
    stats = old_logprobs_and_weights(config(), learner, None, build(config()).rows).stats
    # token_is = none and luffy: b = 1, c = w (the sequence weight stays: kappa and log_rho_min mean the same under
    # every token_is, and its logged statistics are the ones applied); peer_loss_scale multiplies c (outside the spec)
    for token_is, scale in (("none", 1.0), ("luffy", 1.0), ("none", 3.0), ("luffy", 3.0)):
        cfg = config(token_is=token_is, peer_loss_scale=scale)
        weighted = old_logprobs_and_weights(cfg, learner, None, build(cfg).rows)
        rows = weighted.rows
        assert any(row.compat_weight < 0.9 for row in rows)  # so that c = w and c = 1 differ
        for row in rows:
            assert row.token_weight.tolist() == pytest.approx([scale * row.compat_weight] * len(row.completion_ids))
        assert weighted.stats.compat_weight_mean == pytest.approx(stats.compat_weight_mean, rel=1e-6)
    # kappa = 0 gives w = 1: the way to train without the sequence weight, under any token_is
    cfg = config(token_is="luffy", kappa=0.0)
    rows = old_logprobs_and_weights(cfg, learner, None, build(cfg).rows).rows
    assert all(row.token_weight.tolist() == [1.0] * len(row.completion_ids) for row in rows)


def relabelled(group: RolloutGroup, mode: str, temperature: float = 1.0, top_k: int | None = None) -> RolloutGroup:
    """The same group, its stored logprobs labelled `mode` and its rows' sampling settings changed."""
    update = {"logprobs_mode": mode, "temperature": temperature, "top_k": top_k}
    return RolloutGroup(rollouts=[r.model_copy(update=update) for r in group.rollouts])


def test_stored_logprobs_that_are_not_mu_graft_as_rows_without_mu_and_are_counted(char_model, char_tokenizer, bpe_model,
                                                                                 bpe_tokenizer):
    """schemas.mu_is_behaviour decides: 'raw' logprobs away from temperature 1 untruncated, and rescored_unverified
    ones unless graft.trust_unverified_mu, are not the rows' mu: the rows graft as rows without mu (b = 1, w = 1, no
    peer tokenizer needed) and the step counts them (peer_rollouts_mu_set_aside); 'raw' at T = 1 and trusted
    rescored_unverified rows weigh exactly as 'processed' ones do."""
    problem, peer, learner, _ = grafting(char_model, char_tokenizer, bpe_model, bpe_tokenizer)
    own = build_group(problem, ["1", "2", "3", "4"], [0.0] * 4, char_tokenizer, char_model, model_id="learner",
                      tokenizer_id="tok-char")

    def weighed(group: RolloutGroup, tokenizers: dict, **graft) -> tuple[PeerRowCounts, list[TrainSample]]:
        cfg = config(peer_loss_scale=3.0, **graft)
        step = build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", group)], [own],
                          {problem.prompt_id: problem}, tokenizers)
        return step.counts, old_logprobs_and_weights(cfg, learner, None, step.rows).rows

    _, processed = weighed(peer, {"tok-bpe": bpe_tokenizer})
    assert not any(row.without_mu for row in processed)
    set_aside = [relabelled(peer, "raw", 0.7), relabelled(peer, "raw", 1.0, top_k=20), relabelled(peer, "raw", 0.0),
                 relabelled(peer, "rescored_unverified")]
    for group in set_aside:
        counts, rows = weighed(group, {})  # nothing of them is projected: no peer tokenizer needed
        assert counts.mu_set_aside == 4 == counts.projections["none"], group.rollouts[0]
        assert all(row.without_mu and row.behaviour_logprobs is None and math.isnan(row.peer_logprob_sum) for row in rows)
        assert all(row.compat_weight == 1.0 and row.token_weight.tolist() == [3.0] * len(row.completion_ids)
                   for row in rows)
    # every trainer's metrics (graft-train's line, TRL's and verl's graft/ logs) take the count from graft_tally
    tally = graft_tally([], counts, 0, gate=gate_tally([], None), consumed=4, without_mu=4, dropped_non_finite=0)
    assert graft_metrics(tally, WeightStats())["peer_rollouts_mu_set_aside"] == 4
    for group, graft in ((relabelled(peer, "raw", 1.0), {}), (relabelled(peer, "rescored_unverified"),
                                                             {"trust_unverified_mu": True})):
        counts, rows = weighed(group, {"tok-bpe": bpe_tokenizer}, **graft)
        assert counts.mu_set_aside == 0 and not any(row.without_mu for row in rows)
        assert [row.token_weight.tolist() for row in rows] == [row.token_weight.tolist() for row in processed]


def test_union_all_success_and_skipped_groups(char_model, char_tokenizer, bpe_model, bpe_tokenizer):
    problem = PROBLEMS[0]
    peer = build_group(problem, ["\\boxed{19}"] * 2, [1.0, 1.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    own = build_group(problem, ["1", "2"], [0.0, 0.0], char_tokenizer, char_model, model_id="learner", tokenizer_id="tok-char")
    learner = learner_of(char_model, char_tokenizer)
    cfg = config(union_all_success=True)
    rows = build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft_union", peer)], [own],
                      {problem.prompt_id: problem}, {"tok-bpe": bpe_tokenizer}).rows
    # union rewards [0, 0, 1, 1]: advantages -+0.866 over learner failures (on-policy) and peer successes (grafted)
    a = 0.5 / math.sqrt(1 / 3)
    assert [(r.grafted, round(r.advantage, 4)) for r in rows] == [(False, round(-a, 4))] * 2 + [(True, round(a, 4))] * 2
    # a skipped all-fail group stays in the batch with zero advantage (as under GRPO); with
    # optim.skip_zero_advantage its rows need no forward pass
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"skip_zero_advantage": True})})
    rows = build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "skip_no_peer")], [own],
                      {problem.prompt_id: problem}, {}).rows
    assert [(r.grafted, r.advantage) for r in rows] == [(False, 0.0), (False, 0.0)]
    rows = old_logprobs_and_weights(cfg, learner, None, rows).rows
    assert all(r.old_logprobs is None for r in rows)


def test_same_tokenizer_peer_rows_keep_the_sampled_split_and_count_the_mismatch(bpe_model, bpe_tokenizer):
    """docs/algorithm.md section 3: a peer with the learner's tokenizer id must re-tokenise to its stored ids. Where the sampler
    chose a split the canonical encoding would not, the stored ids stay (their logprobs are exact) and the step
    counts it (same_tokenizer_id_mismatch)."""
    problem = PROBLEMS[0]
    peer = build_group(problem, ["\\boxed{19}", "\\boxed{18}"], [1.0, 0.0], bpe_tokenizer, bpe_model, model_id="twin",
                       tokenizer_id="tok-bpe")
    split = bpe_tokenizer("\\b", add_special_tokens=False)["input_ids"] + bpe_tokenizer("oxed{19}", add_special_tokens=False)["input_ids"]
    ids = split + [bpe_tokenizer.eos_token_id]
    resampled = peer.rollouts[0].model_copy(update={
        "completion_token_ids": ids, "token_logprobs": [-0.25] * len(ids), "num_tokens": len(ids),
        "logprob_sum": -0.25 * (len(ids) - 1)})
    peer = RolloutGroup(rollouts=[resampled, peer.rollouts[1]])
    own = build_group(problem, ["1", "2"], [0.0, 0.0], bpe_tokenizer, bpe_model, model_id="learner", tokenizer_id="tok-bpe")
    learner = learner_of(bpe_model, bpe_tokenizer, tokenizer_id="tok-bpe")
    step_rows = build_rows(config(), learner, [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own],
                           {problem.prompt_id: problem}, {})
    rows = step_rows.rows
    assert sum(step_rows.counts.drops.values()) == 0 and step_rows.counts.projections["exact"] == 2
    assert step_rows.counts.same_tokenizer_id_mismatch == 1
    assert rows[0].completion_ids == ids and rows[0].behaviour_logprobs == [-0.25] * len(ids)
    assert rows[1].completion_ids == list(peer.rollouts[1].completion_token_ids)


def test_a_chat_learner_ends_grafted_and_anchor_rows_with_its_end_of_turn(tmp_path, char_model, char_tokenizer, bpe_model,
                                                                         bpe_tokenizer):
    """A learner whose chat turns end with <|im_end|> (one of the tokens its sampling stops on) stops its own
    rollouts there; grafted rows and anchor completions must end the same way, not with eos_token_id."""
    from graft.rollouts.models import tokenizer_fingerprint
    from graft.trainer.learner import load_learner
    from graft.trainer.update import anchor_batch
    from toy.models import build_tiny_model, save_model
    from toy.world import learner_tokenizer

    tokenizer = learner_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = build_tiny_model(tokenizer, "llama", seed=3)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, im_end]
    path = save_model(model, tokenizer, tmp_path / "chat-learner")
    cfg = TrainConfig(model={"path": str(path), "device": "cpu"}, data={"dataset": "unused"}, prompt={"template": "auto"},
                      store={"url": "http://x"}, rollout={"max_response_tokens": 32})
    learner = load_learner(cfg, None)
    assert learner.stop_token_id == im_end != learner.tokenizer.eos_token_id

    problem = PROBLEMS[0]
    peer = build_group(problem, ["\\boxed{19}", "\\boxed{18}"], [1.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer",
                       tokenizer_id="tok-bpe")
    own = build_group(problem, ["1", "2"], [0.0, 0.0], learner.tokenizer, learner.hf_model, model_id="learner",
                      tokenizer_id=tokenizer_fingerprint(learner.tokenizer))
    rows = build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own],
                      {problem.prompt_id: problem}, {"tok-bpe": bpe_tokenizer}).rows
    assert [row.completion_ids[-1] for row in rows] == [im_end, im_end]
    anchor = anchor_batch(cfg, learner, [("12+7=", "\\boxed{19}")], random.Random(0))
    assert anchor[0].completion_ids[-1] == im_end


def without_mu(group: RolloutGroup) -> RolloutGroup:
    """The same group as a source without behaviour logprobs stores it (logprobs_mode 'none', docs/algorithm.md section 11)."""
    no_mu = {"logprobs_mode": "none", "token_logprobs": [], "logprob_sum": None}
    return RolloutGroup(rollouts=[r.model_copy(update=no_mu) for r in group.rollouts])


def test_a_peer_group_without_mu_grafts_with_b_and_w_one_and_is_counted(char_model, char_tokenizer, bpe_model,
                                                                         bpe_tokenizer):
    """docs/algorithm.md section 11: no mu, so b = 1 and w = 1 (w needs l_peer): c = peer_loss_scale on every token, exactly,
    under tis as under none; log rho is not computed for such rows; the rows are counted apart."""
    problem, peer, learner, _ = grafting(char_model, char_tokenizer, bpe_model, bpe_tokenizer)
    text_only = without_mu(peer)
    own = build_group(problem, ["1", "2", "3", "4"], [0.0] * 4, char_tokenizer, char_model, model_id="learner",
                      tokenizer_id="tok-char")
    for token_is in ("tis", "none"):
        cfg = config(token_is=token_is, peer_loss_scale=3.0)
        # no peer tokenizer needed: there is nothing to project
        step_rows = build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", text_only)], [own],
                               {problem.prompt_id: problem}, {})
        assert step_rows.counts.projections["none"] == 4 and sum(step_rows.counts.drops.values()) == 0
        with_mu_rows = build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own],
                                  {problem.prompt_id: problem}, {"tok-bpe": bpe_tokenizer}).rows
        rows = step_rows.rows
        assert [r.completion_ids for r in rows] == [r.completion_ids for r in with_mu_rows]  # the same learner tokens
        assert all(r.grafted and r.without_mu and r.behaviour_logprobs is None for r in rows)
        assert all(math.isnan(r.peer_logprob_sum) for r in rows)  # never the stored 0.0 taken for an l_peer
        weighted = old_logprobs_and_weights(cfg, learner, None, rows)
        assert weighted.dropped_non_finite == 0 and len(weighted.rows) == 4
        for row in weighted.rows:
            assert row.compat_weight == 1.0
            assert row.token_weight.tolist() == [3.0] * len(row.completion_ids)  # b = 1, w = 1, exactly
        stats = weighted.stats
        assert stats.compat_weight_mean == 1.0
        assert math.isnan(stats.log_rho_p50) and math.isnan(stats.behaviour_ratio_p50)
        # the step's count (graft-train's metric peer_rollouts_without_mu; TRL and verl count the same rows)
        outcome = StepOutcome(sampled=None, peers=None, decisions=[], rows=step_rows, weighted=weighted, update=None)
        assert outcome.peer_rollouts_without_mu == 4 == outcome.peer_rollouts_consumed
    # a row with mu keeps its weights beside one without (the statistics over the rows with mu only)
    cfg = config(peer_loss_scale=1.0)
    mixed_rows = build_rows(cfg, learner, [GateDecision(problem.prompt_id, "all_fail", "graft", peer)], [own],
                            {problem.prompt_id: problem}, {"tok-bpe": bpe_tokenizer}).rows[:2] + rows[2:]
    weighted = old_logprobs_and_weights(cfg, learner, None, mixed_rows)
    assert [r.without_mu for r in weighted.rows] == [False, False, True, True]
    assert any(t != 1.0 for t in weighted.rows[0].token_weight.tolist())
    assert weighted.grafted.log_rho.numel() == 2 and not math.isnan(weighted.stats.log_rho_p50)
