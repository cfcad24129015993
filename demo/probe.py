"""The mechanism probe: what each correction does to a grafted group's gradient, in seconds and with no RL noise.

From one of the learner's starts, on the weak-family RL prompts it fails (all of its G samples at T = 1) that have an
informative stored peer group, the grafted rows are built exactly as graft-train builds them (`grafted_group_rows`,
`old_logprobs_and_weights`: re-tokenisation, w, b) under each correction of `ProbeConfig.corrections`, and their loss
(`graft_loss`, at theta = theta_old) is differentiated. Per batch of prompts, the same batches for every correction:

- cos: the cosine between the update direction (minus the grafted loss's gradient) and the gradient of the held-out
  gold answers' mean log-likelihood on the weak family (what a step should raise). Positive: the step teaches.
- the gradient's norm: how far the step moves at a given learning rate.
- the effective weight of a token: |d loss / d log pi(token)| per unit of advantage, times the token count the loss
  averages over (c under the PPO ratio at r = 1; c p gamma / (p + gamma)^2 under LUFFY's shaping). At the decisive
  token of a correct grafted row (the one the learner finds least likely: where the peer's answer departs from the
  learner's habit) it says how much of the peer's signal the correction lets through where it matters.

A reference row gives the same for supervised training on the batch's correct peer answers (the ceiling's direction).
GRPO's gradient on these groups is zero: they are all-fail.

    python -m demo.worker probe <job.json>     (demo.run writes the job; its result is the job's done.json)
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import orjson
import torch

from demo.stats import paired_interval
from graft.rollouts.hf_backend import HFBackend
from graft.rollouts.sampling import SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import Problem
from graft.schemas.overrides import apply_overrides
from graft.trainer.batch import (
    PeerRowCounts,
    TrainSample,
    collate,
    grafted_group_rows,
    old_logprobs_and_weights,
    response_logprobs,
)
from graft.trainer.config import TrainConfig
from graft.trainer.gate import choose_peer_group, classify_group
from graft.trainer.learner import load_learner
from graft.trainer.loss import LossBatch, LossConfig, graft_loss
from toy.task import completion_text

SUPERVISED = "supervised on the peer's correct answers (the ceiling's direction)"


def probe(job: dict, progress=lambda done, total: None) -> dict:
    base = TrainConfig.model_validate(job["train"])
    settings = job["probe"]
    torch.manual_seed(0)
    learner = load_learner(base, None)
    problems = [Problem(**orjson.loads(line)) for line in Path(job["rl_dataset"]).read_bytes().splitlines() if line.strip()]
    weak = [p for p in problems if p.dataset == job["weak_dataset"]]

    # 1. the learner's own groups at its start, sampled as RL samples them; the prompts it fails whole
    failed = all_fail_prompts(base, learner, weak)
    # 2. their stored peer groups, chosen as the gate chooses (the most recent informative one)
    from graft.trainer.data import load_peer_tokenizers
    from graft.trainer.peers import make_source

    peer_tokenizers = load_peer_tokenizers(base)
    exchange = make_source(base, learner.model_id, runs=("prefetch",))
    try:
        request = exchange.request([p.prompt_id for p in failed], 0)
        found = exchange.collect(exchange.start_lookup(request), 60.0)
    finally:
        exchange.close()
    if not found.ok:
        raise SystemExit(f"the probe's peer lookup at {base.store.url} failed: nothing to probe")
    usable = {learner.tokenizer_id, *peer_tokenizers}
    chosen = []
    for problem in failed:
        group, action = choose_peer_group(found.groups.get(problem.prompt_id, []), request, usable)
        if action == "graft":
            chosen.append((problem, group))
    chosen = chosen[: settings["prompts"]]
    size = settings["batch_prompts"]
    batches = [chosen[i : i + size] for i in range(0, len(chosen), size) if len(chosen[i : i + size]) == size]
    if not batches:  # said in the report, not fatal: the RL runs measure what they measure either way
        return {"start": job["start"], "weak_prompts": len(weak), "failed_prompts": len(failed), "probed_prompts": 0,
                "batches": 0, "batch_prompts": size, "corrections": {},
                "empty": f"{len(chosen)} failed prompts with an informative peer group: fewer than one batch of {size}"}

    # 3. the reference direction: the gradient of the held-out gold answers' mean log-likelihood
    gold = [Problem(**orjson.loads(line)) for line in Path(job["eval_weak"]).read_bytes().splitlines() if line.strip()]
    gold_rows = [supervised_row(base, learner, p.problem, completion_text(p.answer)) for p in gold[: settings["gold_problems"]]]
    gold_direction = raise_direction(learner, mean_nll(learner, gold_rows))

    # 4. per batch, per correction: the grafted rows' update direction
    corrections = {name: TrainConfig.model_validate(apply_overrides(base.model_dump(mode="json"), list(overrides)))
                   for name, overrides in settings["corrections"].items()}
    per_batch: dict[str, list[dict]] = {name: [] for name in [*corrections, SUPERVISED]}
    for index, batch in enumerate(batches):
        for name, cfg in corrections.items():
            per_batch[name].append(correction_gradient(cfg, learner, batch, peer_tokenizers, gold_direction))
        rows = [supervised_row(base, learner, problem.problem, rollout.completion_text)
                for problem, group in batch for rollout in group.rollouts if rollout.correct]
        direction = raise_direction(learner, mean_nll(learner, rows))
        per_batch[SUPERVISED].append({"cos": cosine(direction, gold_direction), "grad_norm": float(direction.norm()),
                                      "rows": len(rows)})
        progress(index + 1, len(batches))

    spec_name = next(iter(corrections))
    summary = {}
    for name, values in per_batch.items():
        cos = [v["cos"] for v in values if not math.isnan(v["cos"])]  # NaN: a batch whose rows all had no signal
        entry = {"cos": paired_interval(cos).as_dict(), "grad_norm_mean": statistics.fmean(v["grad_norm"] for v in values),
                 "batches": values}
        if name != spec_name and name in corrections:
            pairs = [(a["cos"], b["cos"]) for a, b in zip(values, per_batch[spec_name]) if not math.isnan(a["cos"] + b["cos"])]
            entry["cos_minus_spec"] = paired_interval([a - b for a, b in pairs]).as_dict()
        decisive = [w for v in values for w in v.get("decisive_weights", [])]
        if decisive:
            entry["decisive_weight_p50"] = statistics.median(decisive)
            entry["decisive_weight_below_0.05"] = sum(w < 0.05 for w in decisive) / len(decisive)
        summary[name] = entry
    return {"start": job["start"], "weak_prompts": len(weak), "failed_prompts": len(failed),
            "probed_prompts": sum(len(b) for b in batches), "batches": len(batches), "batch_prompts": size,
            "gold_problems": len(gold_rows), "spec": spec_name, "corrections": summary}


def all_fail_prompts(cfg: TrainConfig, learner, problems: list[Problem]) -> list[Problem]:
    """The problems whose G samples at the rollout temperature all fail, as the learner's RL step would sample them."""
    backend = HFBackend(learner.hf_model, learner.tokenizer, learner.model_id, batch_size=512)
    G = cfg.rollout.group_size
    params = SamplingParams(n=G, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            max_tokens=cfg.rollout.max_response_tokens, seed=cfg.seed, seed_per_sample=True)
    prompts = [cfg.prompt.render(learner.tokenizer, p.problem) for p in problems]
    samples = backend.generate(prompts, params)  # (prompts, G)
    with Scorer(num_workers=1, timeout_s=5.0) as scorer:
        scores = scorer.score([s.text for group in samples for s in group], [p.answer for p in problems for _ in range(G)])
    return [p for i, p in enumerate(problems) if classify_group([s.reward for s in scores[i * G : (i + 1) * G]]) == "all_fail"]


def correction_gradient(cfg: TrainConfig, learner, batch: list, peer_tokenizers: dict, gold_direction: torch.Tensor) -> dict:
    """One batch's grafted rows under one correction: the update direction's cosine with the gold direction, its norm,
    and the effective weights (per unit of advantage) at the decisive tokens of the correct rows."""
    counts = PeerRowCounts()
    rows: list[TrainSample] = []
    for index, (problem, group) in enumerate(batch):
        prompt_ids = cfg.prompt.token_ids(learner.tokenizer, problem.problem)
        rows += grafted_group_rows(cfg, learner, group, index, prompt_ids, peer_tokenizers, learner.stop_token_id, counts)
    # rows without signal (a group whose rows that survive re-tokenisation share one reward has zero advantages) get
    # no forward pass under optim.skip_zero_advantage, and add nothing to the gradient either way
    rows = [row for row in old_logprobs_and_weights(cfg, learner, None, rows).rows if row.old_logprobs is not None]
    if not rows:
        return {"cos": math.nan, "grad_norm": 0.0, "rows": 0, "decisive_weights": [], "dropped": sum(counts.drops.values())}
    tokens = collate(rows, learner.tokenizer.pad_token_id)
    logprobs = response_logprobs(learner.grad_model, tokens, cfg.rollout.temperature)  # (B, T), with grad
    logprobs.retain_grad()
    width = logprobs.shape[1]
    loss_batch = LossBatch(
        logprobs=logprobs, old_logprobs=_pad([r.old_logprobs for r in rows], width),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32), mask=tokens.mask,
        token_weight=_pad([r.token_weight for r in rows], width), is_grafted=torch.ones(len(rows), dtype=torch.bool))
    loss, _ = graft_loss(loss_batch, LossConfig.from_train(cfg))
    params = [p for p in learner.grad_model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss.backward()
    direction = -torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])  # down the loss
    for p in params:
        p.grad = None
    per_token = logprobs.grad.abs() * float(tokens.mask.sum())  # (B, T): |d loss / d log pi| times the token count
    decisive = []
    for b, row in enumerate(rows):
        if row.advantage > 0 and row.num_content_tokens > 0:
            t = int(torch.argmin(row.old_logprobs[: row.num_content_tokens]))
            decisive.append(float(per_token[b, t]) / row.advantage)
    return {"cos": cosine(direction, gold_direction), "grad_norm": float(direction.norm()), "rows": len(rows),
            "decisive_weights": decisive, "dropped": sum(counts.drops.values())}


def supervised_row(cfg: TrainConfig, learner, problem: str, completion: str) -> TrainSample:
    prompt_ids = cfg.prompt.token_ids(learner.tokenizer, problem)
    ids = list(learner.tokenizer(completion, add_special_tokens=False)["input_ids"]) + [learner.end_token_id]
    return TrainSample(prompt_id="", group=-1, prompt_ids=prompt_ids, completion_ids=ids, num_content_tokens=len(ids) - 1,
                       advantage=0.0, grafted=False, num_bytes=len(completion.encode()))


def mean_nll(learner, rows: list[TrainSample]) -> torch.Tensor:
    """The rows' token-mean negative log-likelihood (with grad)."""
    tokens = collate(rows, learner.tokenizer.pad_token_id)
    logprobs = response_logprobs(learner.grad_model, tokens)  # (B, T)
    return -(logprobs * tokens.mask).sum() / tokens.mask.sum()


def raise_direction(learner, nll: torch.Tensor) -> torch.Tensor:
    """The flat parameter direction that raises what `nll` scores: minus its gradient."""
    params = [p for p in learner.grad_model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(nll, params, allow_unused=True)
    return -torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else math.nan


def _pad(values: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(values), width))
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out
