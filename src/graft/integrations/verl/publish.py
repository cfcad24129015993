"""A verl run as a peer: what `GraftPPOTrainer` publishes of its own groups (graft.publish, or graft.peer_source cotrain)
and which behaviour logprobs (mu) they carry, and the problems its wants and groups name.

verl keeps the rollout engine's logprobs of the sampled tokens in each trajectory's `rollout_log_probs`, when it asks the
engine for them (actor_rollout_ref.rollout.calculate_log_probs, true in verl's rollout config). What they are is the
engine's business, and so whether the stored rows carry mu (schemas.mu_is_behaviour):
- vLLM: its logprobs_mode, which verl passes on (actor_rollout_ref.rollout.logprobs_mode): processed_logprobs (verl's
  default), the sampled distribution's: mu (`processed`); raw_logprobs, the model's own: `raw` (mu only at temperature 1
  without a top-p or top-k cut); a logits mode: no logprobs, published without mu.
- another engine (SGLang, TensorRT-LLM): which distribution its logprobs are of is not stated to verl; where sampling
  changes nothing (temperature 1, no cut) every reading is the model's own: `raw`, mu; else published without mu.
No rollout_log_probs: published without mu. The start says which, in one line.
"""

from __future__ import annotations

from typing import Any

import transfer_queue as tq
from omegaconf import DictConfig, OmegaConf
from transfer_queue import KVBatchMeta

from graft.rollouts.sampling import SamplingParams, samples_the_model
from graft.schemas import NO_LOGPROBS, Problem, prompt_id
from graft.trainer import OwnRow

ROLLOUT = "actor_rollout_ref.rollout"


def sampler_logprobs(config: DictConfig) -> tuple[SamplingParams, str, str]:
    """What verl's rollout samples training batches with (stored with the rows), what its logprobs are
    (processed_logprobs, raw_logprobs or none: `assemble_group`'s engine mode) and a line saying which."""
    def value(name: str, default: Any = None) -> Any:
        found = OmegaConf.select(config, f"{ROLLOUT}.{name}", default=default, throw_on_missing=False)
        return default if found is None else found

    top_k = int(value("top_k", -1))
    params = SamplingParams(n=int(value("n", 1)), temperature=float(value("temperature", 1.0)),
                            top_p=float(value("top_p", 1.0)), top_k=top_k if top_k > 0 else None,
                            max_tokens=int(OmegaConf.select(config, "data.max_response_length")))
    if not value("calculate_log_probs", False):
        return params, NO_LOGPROBS, (f"none: verl does not ask its rollout engine for logprobs ({ROLLOUT}."
                                     "calculate_log_probs=false): published without mu")
    engine, mode = value("name"), value("logprobs_mode", "processed_logprobs")
    if engine == "vllm":
        if mode in ("processed_logprobs", "raw_logprobs"):
            return params, mode, (f"vLLM's {mode} ({ROLLOUT}.logprobs_mode)" + (
                ": the sampled distribution's, mu" if mode == "processed_logprobs" else
                ": the model's own, mu only at temperature 1 without a top-p or top-k cut"))
        return params, NO_LOGPROBS, f"vLLM's {mode} ({ROLLOUT}.logprobs_mode) is no logprobs: published without mu"
    if samples_the_model(params.temperature, params.top_p, params.top_k):
        return params, "raw_logprobs", (f"the {engine or 'rollout'} engine's, at temperature 1 without a cut: the "
                                        "model's own distribution, which it sampled from: mu")
    return params, NO_LOGPROBS, (f"the {engine or 'rollout'} engine's, whose distribution (before or after the "
                                 "temperature and the top-p/top-k cut) verl does not state: published without mu")


def own_rows(batch: KVBatchMeta, groups: dict[str, list[int]], rewards: list[float], tokenizer: Any,
             eos_ids: set[int], logprobs_mode: str) -> dict[str, list[OwnRow]]:
    """The batch's trajectories as they were sampled, before the splice writes over any (uid -> its rows, in session
    order): the response tokens, their rollout_log_probs (unless published without mu), texts, rewards."""
    fields = ["responses", "response_mask"] + (["rollout_log_probs"] if logprobs_mode != NO_LOGPROBS else [])
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    responses, masks = data["responses"].unbind(), data["response_mask"].unbind()
    logprobs = data["rollout_log_probs"].unbind() if "rollout_log_probs" in data.keys() else [None] * len(batch)
    rows: dict[str, list[OwnRow]] = {}
    for uid, indices in groups.items():
        rows[uid] = []
        for i in indices:
            sampled = masks[i].bool()  # single-turn: every response token (multi-turn is refused)
            ids = responses[i][sampled].tolist()
            rows[uid].append(OwnRow(ids, logprobs[i][sampled].tolist() if logprobs[i] is not None else None,
                                    tokenizer.decode(ids, skip_special_tokens=True), bool(ids) and ids[-1] in eos_ids,
                                    rewards[i]))
    return rows


def problems_of(extra: list[dict], reward_models: list[Any], id_key: str, problem_key: str, dataset: str,
                required: bool) -> dict[str, Problem]:
    """The problems of a prompt batch (prompt id -> problem): each row's extra_info[problem_key], whose prompt_id must
    be the row's id, and its reward_model.ground_truth. `required` (store_options.want_misses: a want carries its
    problem): a row without them, or whose text names another id, stops the step saying so; else it is left out."""
    problems: dict[str, Problem] = {}
    for info, reward_model in zip(extra, reward_models, strict=True):
        text = info.get(problem_key)
        answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        known = isinstance(text, str) and bool(text.strip()) and answer is not None and prompt_id(text) == info[id_key]
        if known:
            problems[info[id_key]] = Problem(prompt_id=info[id_key], dataset=dataset, problem=text, answer=str(answer))
        elif required:
            raise KeyError(f"graft.store_options.want_misses: a want carries its prompt's problem and gold answer (a "
                           f"generator samples and scores it), and the dataset row of prompt {info[id_key]} has no "
                           f"extra_info.{problem_key} whose schemas.prompt_id is that id, or no reward_model.ground_truth "
                           "(name the key in graft.problem_key)")
    return problems
