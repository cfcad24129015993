"""Behaviour logprobs (mu) computed after the fact: a stored group's completions teacher-forced through the peer's
weights, in-process with transformers or by a vLLM server's `prompt_logprobs` (`graft-rescore`).

The rescored group is a new group (a new id; the source group stays as it was): the same texts, rewards, advantages
and stated sampling (temperature, top-p, top-k: what the trace was sampled at, never rewritten), the rescoring
tokenizer's ids, and each token's logprob under the weights at that sampling, with `logprobs_mode` 'rescored' when
the weights are shown to be the trace's author, else 'rescored_unverified' (their likelihood of the text, not the
behaviour policy's). A rescorer that cannot apply a row's stated sampling refuses the group (`Rescorer.cannot_apply`): a vLLM
server's prompt logprobs are the temperature-1 distribution without truncation, so a served rescoring takes only rows
sampled so.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timezone
from typing import Protocol

from graft.rollouts.hf_backend import teacher_forced_logprobs
from graft.rollouts.sampling import SamplingParams
from graft.schemas import RESCORED, RESCORED_UNVERIFIED, SCHEMA_VERSION, RolloutGroup


class Rescorer(Protocol):
    """Teacher-forced logprobs of completions after a prompt, under one model's weights."""

    tokenizer: object  # a transformers tokenizer: prompts and re-tokenised texts are its ids
    tokenizer_id: str
    eos_token_ids: set[int]
    name: str  # 'hf' or 'openai': in the rows' generator_id

    def logprobs(self, prompt_ids: list[int], completions: list[list[int]], params: SamplingParams) -> list[list[float]]:
        """One list per completion: the logprob of each of its tokens (params: the rows' stated sampling)."""
        ...

    def cannot_apply(self, params: SamplingParams) -> str | None:
        """Why these weights' logprobs here would not be the distribution `params` states (None: they would be)."""
        ...

    def close(self) -> None:
        """Free the weights, or the server's connections."""
        ...


def _greedy(params: SamplingParams) -> str | None:
    return ("the rows were sampled greedily (temperature 0): a token's probability is 1 or 0, there is no mu to "
            "rescore" if params.greedy else None)


class HFRescorer:
    """In-process: one forward pass over a group's completions (right-padded after the shared prompt)."""

    name = "hf"

    def __init__(self, model, tokenizer, tokenizer_id: str, eos_token_ids: set[int]):
        self.model, self.tokenizer, self.tokenizer_id, self.eos_token_ids = model.eval(), tokenizer, tokenizer_id, eos_token_ids

    def cannot_apply(self, params: SamplingParams) -> str | None:
        return _greedy(params)  # temperature, top-p and top-k are applied as the hf sampler applies them

    def logprobs(self, prompt_ids: list[int], completions: list[list[int]], params: SamplingParams) -> list[list[float]]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return teacher_forced_logprobs(self.model, prompt_ids, completions, params, pad)

    def close(self) -> None:
        self.model = None


class ServedRescorer:
    """A vLLM server's prompt_logprobs (`OpenAIBackend.teacher_forced_logprobs`): the temperature-1 distribution."""

    name = "openai"

    def __init__(self, backend):
        self.backend = backend
        self.tokenizer, self.tokenizer_id, self.eos_token_ids = backend.tokenizer, backend.tokenizer_id, backend.eos_token_ids

    def cannot_apply(self, params: SamplingParams) -> str | None:
        if not params.model_distribution:
            return (f"the rows were sampled at temperature {params.temperature:g}, top_p {params.top_p:g}, top_k "
                    f"{params.effective_top_k}, and a vLLM server's prompt logprobs are the temperature-1 distribution "
                    "without top-p or top-k: rescore them in-process (--backend hf)")
        return None

    def logprobs(self, prompt_ids: list[int], completions: list[list[int]], params: SamplingParams) -> list[list[float]]:
        reason = self.cannot_apply(params)
        if reason is not None:
            raise ValueError(reason)
        return self.backend.teacher_forced_logprobs(prompt_ids, completions)

    def close(self) -> None:
        self.backend.close()


def rescored_group_id(source_group_id: str, model_id: str, model_revision: str, params: SamplingParams) -> str:
    """Deterministic: a rescoring run again recomputes the ids it stored and skips them."""
    key = "\x1f".join([RESCORED, source_group_id, model_id, model_revision, repr(params.temperature), repr(params.top_p),
                       repr(params.effective_top_k)])
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def rescore_group(group: RolloutGroup, prompt_ids: list[int], rescorer: Rescorer, params: SamplingParams, *,
                  model_id: str, model_revision: str, mode: str = RESCORED,
                  prompt_text: str | None = None) -> RolloutGroup:
    """The group with mu from `rescorer` at `params`, the rows' stated sampling (a new group id, rows `mode`:
    'rescored' or 'rescored_unverified'), conditioned on `prompt_ids` (the rescoring tokenizer's: stored with the
    rows, with `prompt_text` where known). Completions stored in another tokenizer's ids are re-tokenised from their
    text (the EOS of the rescoring tokenizer appended to a finished one). ValueError when the rescorer cannot apply
    the sampling, or the prompt is empty."""
    if mode not in (RESCORED, RESCORED_UNVERIFIED):
        raise ValueError(f"rescored rows are {RESCORED!r} or {RESCORED_UNVERIFIED!r}, not {mode!r}")
    reason = rescorer.cannot_apply(params)
    if reason is not None:
        raise ValueError(reason)
    if not prompt_ids:
        raise ValueError(f"group {group.group_id}: its prompt tokenises to nothing: nothing to condition on")
    source = group.rollouts[0]
    same_tokens = source.tokenizer_id == rescorer.tokenizer_id
    eos = rescorer.tokenizer.eos_token_id
    completions = []
    for r in group.rollouts:
        if same_tokens:
            completions.append(list(r.completion_token_ids))
        else:
            ended = [eos] if r.finish_reason == "stop" and eos is not None else []
            completions.append(rescorer.tokenizer(r.completion_text, add_special_tokens=False)["input_ids"] + ended)
    logprobs = rescorer.logprobs(prompt_ids, completions, params)
    group_id = rescored_group_id(group.group_id, model_id, model_revision, params)
    now = datetime.now(timezone.utc)
    rollouts = []
    for position, (r, ids, lps) in enumerate(zip(group.rollouts, completions, logprobs, strict=True)):
        if len(lps) != len(ids):
            raise ValueError(f"rollout {r.rollout_id}: the rescorer gave {len(lps)} logprobs for {len(ids)} tokens")
        if not all(math.isfinite(lp) for lp in lps):
            raise ValueError(f"rollout {r.rollout_id}: a token has probability 0 under the weights at temperature "
                             f"{params.temperature}, top_p {params.top_p}, top_k {params.effective_top_k} (outside the "
                             "top-p/top-k support, or NaN logits): these weights could not have sampled it so; rescore "
                             "with top_p=1 and no top_k")
        ends_with_eos = r.finish_reason == "stop" and bool(ids) and ids[-1] in rescorer.eos_token_ids
        text_logprobs = lps[:-1] if ends_with_eos else lps  # logprob_sum excludes EOS, as the generator's does
        rollouts.append(r.model_copy(update={
            "rollout_id": f"{group_id}-{position}", "group_id": group_id, "model_id": model_id,
            "model_revision": model_revision, "tokenizer_id": rescorer.tokenizer_id, "created_at": now,
            "generator_id": f"graft-rescore:{rescorer.name}", "logprobs_mode": mode, "completion_token_ids": ids,
            "token_logprobs": lps, "logprob_sum": min(0.0, float(sum(text_logprobs))),
            "num_tokens": len(ids), "schema_version": SCHEMA_VERSION, "prompt_text": prompt_text,
            "prompt_token_ids": list(prompt_ids),
        }))
    # model_copy skips validation: the group is rebuilt from validated rows
    return RolloutGroup(rollouts=[type(r).model_validate(r.model_dump()) for r in rollouts])
