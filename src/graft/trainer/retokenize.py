"""Peer completions in the learner's tokens, and the peer's per-token logprobs projected onto them.

docs/algorithm.md section 3 (re-tokenisation) and section 5 (mu~, the projected behaviour probability):
- the completion text is tokenised with the learner's tokenizer (no special tokens); the token the
  learner's own rollouts stop on (`learner_stop_token`: a chat learner's end of turn) is appended
  when the peer finished with `stop`;
- the sample is dropped when decode(encode(text)) != text (round trip) or when it is longer than the
  learner's max response length (never truncated: the reward belongs to the whole text), or when
  its stored logprobs are not finite;
- projection: every peer token owns the characters it decodes to; its log-mass is spread evenly
  over them; every learner token takes the mass of the characters it covers, so the projected
  content logprobs sum to the peer's logprob_sum. When the tokenizers are the same (same
  tokenizer id) the learner's tokens are the peer's tokens and the logprobs are copied exactly;
  whether re-tokenising the text reproduces them is reported (a sampler may choose a split the
  canonical encoding would not, and then the stored ids are the ones whose probabilities we know).
- without the peer's tokenizer there is no projection: the gate refuses such groups, unless
  `graft.uniform_projection` opts in to spreading the peer's log-mass evenly over characters.
- a row without behaviour logprobs (logprobs_mode 'none', docs/algorithm.md section 11) is re-tokenised the same way and
  has nothing to project: its PeerTokens carry no behaviour logprobs (projection "none"), and the trainer grafts it
  with b = 1 and w = 1. So is a row whose stored logprobs are not its mu (`schemas.mu_is_behaviour`: 'raw' logprobs
  away from temperature 1, rescored_unverified ones unless trusted): they are set aside (`mu_set_aside`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal, get_args

import numpy as np
from transformers import PreTrainedTokenizerBase

from graft.schemas import NO_LOGPROBS, Rollout, mu_is_behaviour

# peer_decode: the peer's stored ids do not decode to its stored text with the tokenizer configured for its id
DropReason = Literal["round_trip", "overlength", "non_finite", "peer_decode"]
Projection = Literal["exact", "spans", "uniform", "none"]  # none: the row has no behaviour logprobs to project


def drop_counts() -> dict[str, int]:
    """Every DropReason at 0: a step's (or batch's) count of dropped peer rollouts, every reason present."""
    return dict.fromkeys(get_args(DropReason), 0)


def projection_counts() -> dict[str, int]:
    """Every Projection at 0: how a step's grafted rows' behaviour logprobs were projected, every kind present."""
    return dict.fromkeys(get_args(Projection), 0)


@dataclass
class PeerTokens:
    """One peer rollout as learner tokens."""

    token_ids: list[int]  # (n,) learner token ids of the completion, plus the learner's EOS when the peer stopped
    # (n,) log mu~ per learner token (the EOS gets the peer's EOS logprob); None: the peer row has no mu
    behaviour_logprobs: list[float] | None
    num_content_tokens: int  # tokens before the EOS (n - 1 with EOS, n without)
    projection: Projection  # exact: same tokenizer; spans: character-span projection; uniform: peer tokenizer unknown;
    # none: the peer row has no behaviour logprobs (logprobs_mode 'none', or stored ones that are not mu)
    # exact only: encoding the text gives the stored ids (False: the sampler's own split, kept)
    canonical: bool = True
    mu_set_aside: bool = False  # projection none: the row stored logprobs, which are not its mu (mu_is_behaviour)


def learner_stop_token(tokenizer: PreTrainedTokenizerBase, eos_ids: set[int], prompt_template: str) -> int:
    """The token the learner's own rollouts end with, which grafted rows must end with too.

    A learner prompted through its chat template ends its turn with the template's end-of-turn token
    (Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`), which may differ from `eos_token_id`; that token is
    used when sampling stops on it (it is one of `eos_ids`). Otherwise the tokenizer's EOS."""
    has_chat = getattr(tokenizer, "chat_template", None) is not None
    if prompt_template == "chat" or (prompt_template == "auto" and has_chat):
        marker = "GRAFT-END-OF-CONTENT"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}], tokenize=False
        )
        after = rendered[rendered.rfind(marker) + len(marker):] if marker in rendered else ""
        following = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        if following and following[0] in eos_ids:
            return int(following[0])
    if tokenizer.eos_token_id is None:
        raise ValueError("the learner's tokenizer has no eos_token; set one (tokenizer.eos_token) before training")
    return int(tokenizer.eos_token_id)


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """Text of `token_ids`; straight through the Rust tokenizer when there is one (the wrapper costs
    more than the decoding on short pieces, and the incremental decoder calls this per token)."""
    if tokenizer.is_fast:
        return tokenizer.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], list[int] | None]:
    """Token ids of `text` without special tokens, and each token's first character (None for a slow tokenizer)."""
    if tokenizer.is_fast:
        encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [start for start, _ in encoding.offsets]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None


def _monotone_starts(starts: list[int], text_len: int) -> list[int]:
    """Offsets may skip characters (trimmed spaces) or overlap (merged bytes): make the starts
    non-decreasing from 0, so that every character belongs to exactly one unit (a running maximum from 0, at most
    `text_len`)."""
    if not starts:
        return []
    return [min(start, text_len) for start in accumulate(starts[1:], max, initial=0)]


def token_char_starts(tokenizer: PreTrainedTokenizerBase, text: str, token_ids: list[int]) -> list[int] | None:
    """First character (in `text`) of each token in `token_ids`, non-decreasing, the first one 0.

    Tokens that share a start (bytes of one character split over several tokens) form one unit
    that owns the characters up to the next larger start. Uses the fast tokenizer's offsets when
    `token_ids` is the canonical encoding of `text`, else decodes incrementally. None when the ids
    do not decode to `text`."""
    if not token_ids:
        return [] if text == "" else None
    canonical, starts = encode(tokenizer, text)
    if starts is None or canonical != list(token_ids):
        starts = _starts_by_incremental_decode(tokenizer, list(token_ids), text)
        if starts is None:
            return None
    return _monotone_starts(starts, len(text))


def _starts_by_incremental_decode(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], text: str
) -> list[int] | None:
    """Character starts by decoding a short window at a time (vLLM's incremental detokenisation).

    The window starts one emitted unit back, so decoders that strip a leading space on the first
    token still give the right characters. Tokens that end inside a UTF-8 character emit nothing
    and join the unit of the token that completes it."""
    starts: list[int] = []
    prefix_offset = read_offset = emitted = 0
    pending: list[int] = []
    for k in range(len(token_ids)):
        prefix_text = decode(tokenizer, token_ids[prefix_offset:read_offset])
        new_text = decode(tokenizer, token_ids[prefix_offset : k + 1])
        pending.append(k)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            starts.extend([emitted] * len(pending))
            emitted += len(new_text) - len(prefix_text)
            pending = []
            prefix_offset, read_offset = read_offset, k + 1
    starts.extend([emitted] * len(pending))
    if decode(tokenizer, token_ids) != text or emitted != len(text):
        return None
    return starts


def _unit_bounds(starts: list[int], text_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token (n,): the [start, end) characters of the unit it belongs to (end = next larger start)."""
    starts_arr = np.asarray(starts, dtype=np.int64)  # (n,)
    ends = np.empty_like(starts_arr)  # (n,)
    next_start = text_len
    for k in range(len(starts) - 1, -1, -1):
        ends[k] = next_start
        if k > 0 and starts[k - 1] < starts[k]:
            next_start = starts[k]
    return starts_arr, ends


def project_logprobs(
    text_len: int, peer_starts: list[int], peer_logprobs: list[float], learner_starts: list[int]
) -> list[float]:
    """Project per-token peer logprobs onto learner tokens by characters; the sums agree.

    Each peer unit (tokens sharing a start) spreads its summed log-mass evenly over its characters;
    each learner unit takes the mass of its characters, split evenly over its tokens."""
    if text_len == 0:
        return [0.0] * len(learner_starts)
    char_mass = np.zeros(text_len, dtype=np.float64)  # (text_len,) peer log-mass per character
    peer_begin, peer_end = _unit_bounds(peer_starts, text_len)
    for k, lp in enumerate(peer_logprobs):
        begin, end = int(peer_begin[k]), int(peer_end[k])
        if end > begin:
            char_mass[begin:end] += lp / (end - begin)
        else:  # a unit that emitted no characters at the very end: keep its mass on the last character
            char_mass[text_len - 1] += lp
    cumulative = np.concatenate([[0.0], np.cumsum(char_mass)])  # (text_len + 1,)
    learner_begin, learner_end = _unit_bounds(learner_starts, text_len)
    unit_size = np.bincount(np.asarray(learner_starts, dtype=np.int64), minlength=text_len + 1)  # tokens per start
    projected = (cumulative[learner_end] - cumulative[learner_begin]) / unit_size[learner_begin]  # (n,)
    return projected.tolist()


def retokenize_peer_rollout(
    rollout: Rollout,
    learner_tokenizer: PreTrainedTokenizerBase,
    learner_tokenizer_id: str,
    max_response_tokens: int,
    peer_tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    stop_token_id: int | None = None,
    uniform_projection: bool = False,
    trust_unverified_mu: bool = False,
) -> PeerTokens | DropReason:
    """The learner's tokens for a peer rollout and log mu~ on them, or why the sample is dropped.

    peer_tokenizer: the tokenizer of `rollout.tokenizer_id` (not needed when it is the learner's).
    stop_token_id: what a finished row ends with (`learner_stop_token`; default the learner's EOS).
    uniform_projection: without `peer_tokenizer`, spread the peer's log-mass evenly over characters
    (an explicit opt-in; otherwise a missing peer tokenizer is an error: the gate refuses such groups).
    A row without behaviour logprobs (logprobs_mode 'none'), or whose stored logprobs are not its mu
    (`mu_is_behaviour`, trust_unverified_mu: graft.trust_unverified_mu), needs no peer tokenizer: its text is tokenised
    and nothing is projected (behaviour_logprobs None)."""
    if not mu_is_behaviour(rollout, trust_unverified=trust_unverified_mu):
        tokens = _retokenize_without_mu(rollout, learner_tokenizer, learner_tokenizer_id, max_response_tokens,
                                        stop_token_id)
        if isinstance(tokens, PeerTokens):
            tokens.mu_set_aside = rollout.logprobs_mode != NO_LOGPROBS
        return tokens
    peer_logprobs = list(rollout.token_logprobs)
    if not math.isfinite(rollout.logprob_sum) or not all(math.isfinite(lp) and lp <= 1e-6 for lp in peer_logprobs):
        return "non_finite"
    text = rollout.completion_text
    finished = rollout.finish_reason == "stop"
    # The stored logprob_sum excludes the EOS; what the token logprobs hold beyond it is the EOS's logprob.
    peer_eos_logprob = min(0.0, sum(peer_logprobs) - rollout.logprob_sum) if finished else 0.0
    learner_eos = learner_tokenizer.eos_token_id if stop_token_id is None else stop_token_id
    if finished and learner_eos is None:
        raise ValueError(
            "the learner's tokenizer has no eos_token; set one (tokenizer.eos_token) before grafting finished peer texts"
        )

    projection: Projection
    canonical = True
    if rollout.tokenizer_id == learner_tokenizer_id:
        # Same tokenizer: the learner's tokens are the peer's sampled tokens (EOS stripped), which
        # the canonical encoding reproduces unless the sampler chose a non-canonical split; either
        # way the stored logprobs are the exact behaviour probabilities of these tokens.
        special_ids = set(learner_tokenizer.all_special_ids)
        content = list(rollout.completion_token_ids)
        content_logprobs = list(peer_logprobs)
        while content and content[-1] in special_ids:
            content.pop()
            content_logprobs.pop()
        if decode(learner_tokenizer, content) != text:
            return "round_trip"
        learner_ids, behaviour = content, content_logprobs
        projection = "exact"
        canonical = encode(learner_tokenizer, text)[0] == content
    else:
        if peer_tokenizer is None and not uniform_projection:
            raise ValueError(
                f"no tokenizer for the peer's tokenizer_id {rollout.tokenizer_id!r}: map it to the peer's tokenizer "
                "directory in graft.peer_tokenizers, or opt in to graft.uniform_projection"
            )
        learner_ids, learner_starts = encode(learner_tokenizer, text)
        if decode(learner_tokenizer, learner_ids) != text:
            return "round_trip"
        if learner_starts is None:
            learner_starts = token_char_starts(learner_tokenizer, text, learner_ids) or [0] * len(learner_ids)
        projected = _project(rollout, text, _monotone_starts(learner_starts, len(text)), peer_tokenizer, uniform_projection)
        if projected is None:
            return "peer_decode"
        behaviour, projection = projected

    num_content = len(learner_ids)
    if finished:
        learner_ids = learner_ids + [learner_eos]
        behaviour = behaviour + [peer_eos_logprob]
    if len(learner_ids) > max_response_tokens:
        return "overlength"
    if not all(math.isfinite(lp) for lp in behaviour):
        return "non_finite"
    return PeerTokens(learner_ids, behaviour, num_content_tokens=num_content, projection=projection, canonical=canonical)


def _retokenize_without_mu(
    rollout: Rollout, learner_tokenizer: PreTrainedTokenizerBase, learner_tokenizer_id: str, max_response_tokens: int,
    stop_token_id: int | None,
) -> PeerTokens | DropReason:
    """The learner's tokens for a peer row whose mu is unknown: the stored ids (EOS stripped) under the learner's
    tokenizer id, else the text encoded; the learner's stop token appended when the peer stopped; no logprobs."""
    text = rollout.completion_text
    finished = rollout.finish_reason == "stop"
    learner_eos = learner_tokenizer.eos_token_id if stop_token_id is None else stop_token_id
    if finished and learner_eos is None:
        raise ValueError(
            "the learner's tokenizer has no eos_token; set one (tokenizer.eos_token) before grafting finished peer texts"
        )
    canonical = True
    if rollout.tokenizer_id == learner_tokenizer_id:
        special_ids = set(learner_tokenizer.all_special_ids)
        content = list(rollout.completion_token_ids)
        while content and content[-1] in special_ids:
            content.pop()
        canonical = encode(learner_tokenizer, text)[0] == content
    else:
        content = encode(learner_tokenizer, text)[0]
    if decode(learner_tokenizer, content) != text:
        return "round_trip"
    token_ids = content + [learner_eos] if finished else content
    if len(token_ids) > max_response_tokens:
        return "overlength"
    return PeerTokens(token_ids, None, num_content_tokens=len(content), projection="none", canonical=canonical)


def _project(
    rollout: Rollout, text: str, learner_starts: list[int], peer_tokenizer: PreTrainedTokenizerBase | None,
    uniform_projection: bool,
) -> tuple[list[float], Projection] | None:
    """Projected peer content logprobs on the learner's content tokens (given by their first
    characters), and which projection was used; None when the peer's ids do not decode to its text
    (a wrong tokenizer for its id, or a damaged row) and the uniform projection is not opted in."""
    if peer_tokenizer is not None:
        special_ids = set(peer_tokenizer.all_special_ids)
        content = list(rollout.completion_token_ids)
        content_logprobs = list(rollout.token_logprobs)
        while content and content[-1] in special_ids:
            content.pop()
            content_logprobs.pop()
        peer_starts = token_char_starts(peer_tokenizer, text, content)
        if peer_starts is not None:
            return project_logprobs(len(text), peer_starts, content_logprobs, learner_starts), "spans"
    if not uniform_projection:
        return None
    # Opted in: spread the peer's log-mass evenly over characters (the sum still equals logprob_sum, but
    # mu~ per token, and so b, carries little).
    if not text:
        return [0.0] * len(learner_starts), "uniform"
    return project_logprobs(len(text), [0], [rollout.logprob_sum], learner_starts), "uniform"
