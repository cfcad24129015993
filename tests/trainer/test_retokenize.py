"""Re-tokenisation of peer text and projection of peer logprobs onto learner tokens (docs/algorithm.md sections 3 and 5)."""

from __future__ import annotations

import pytest

from graft.schemas import Problem, Rollout
from graft.trainer.retokenize import (
    PeerTokens,
    learner_stop_token,
    project_logprobs,
    retokenize_peer_rollout,
    token_char_starts,
)

PROBLEM = Problem.from_text("12+7=", "19", "toy_add")
TEXTS = ["\\boxed{19}", "\\boxed{18}", "\\boxed{109} ", "\\boxed{1"]


def test_projection_by_hand():
    # peer tokens "ab" | "1" with logprobs -2, -1; learner tokens a | b | 1: "ab" spreads -1 per character
    assert project_logprobs(3, [0, 2], [-2.0, -1.0], [0, 1, 2]) == pytest.approx([-1.0, -1.0, -1.0])
    # peer a | b | 1 -> learner "ab" | "1": masses add up
    assert project_logprobs(3, [0, 1, 2], [-0.3, -0.6, -0.9], [0, 2]) == pytest.approx([-0.9, -0.9])
    # a character split over two peer tokens (same start) forms one unit; two learner tokens sharing a
    # character split its mass evenly
    assert project_logprobs(2, [0, 1, 1], [-1.0, -0.25, -0.75], [0, 1]) == pytest.approx([-1.0, -1.0])
    assert project_logprobs(2, [0, 1], [-1.0, -1.0], [0, 1, 1]) == pytest.approx([-1.0, -0.5, -0.5])
    # overlapping units: peer "abc" (one token) onto learner "a" | "bc"
    assert project_logprobs(3, [0], [-3.0], [0, 1]) == pytest.approx([-1.0, -2.0])


def test_char_starts_from_offsets_and_from_incremental_decode(bpe_tokenizer, char_tokenizer):
    text = "\\boxed{19}"
    canonical = bpe_tokenizer(text, add_special_tokens=False)["input_ids"]
    starts = token_char_starts(bpe_tokenizer, text, canonical)
    pieces = [bpe_tokenizer.decode([t]) for t in canonical]
    assert starts == [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    # A non-canonical split (as a sampler may produce) is mapped by incremental decoding.
    split = bpe_tokenizer("\\b", add_special_tokens=False)["input_ids"] + bpe_tokenizer("oxed{19}", add_special_tokens=False)["input_ids"]
    assert split != canonical
    starts = token_char_starts(bpe_tokenizer, text, split)
    pieces = [bpe_tokenizer.decode([t]) for t in split]
    assert starts == [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    # Multi-byte characters: byte-level pieces of one character share its start.
    ids = bpe_tokenizer("1 é", add_special_tokens=False)["input_ids"]
    assert token_char_starts(bpe_tokenizer, "1 é", ids)[-1] == 2
    assert token_char_starts(char_tokenizer, "12", char_tokenizer("12", add_special_tokens=False)["input_ids"]) == [0, 1]
    assert token_char_starts(char_tokenizer, "13", char_tokenizer("12", add_special_tokens=False)["input_ids"]) is None


def test_bpe_peer_onto_char_learner_preserves_logprob_sum(make_group, bpe_tokenizer, bpe_model, char_tokenizer):
    group = make_group(PROBLEM, TEXTS, [1.0, 0.0, 0.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    for rollout in group.rollouts:
        out = retokenize_peer_rollout(rollout, char_tokenizer, "tok-char", 64, peer_tokenizer=bpe_tokenizer)
        assert isinstance(out, PeerTokens) and out.projection == "spans"
        text = rollout.completion_text
        assert out.token_ids[:-1] == char_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert out.token_ids[-1] == char_tokenizer.eos_token_id and out.num_content_tokens == len(text)
        assert sum(out.behaviour_logprobs[:-1]) == pytest.approx(rollout.logprob_sum, abs=1e-4)
        assert out.behaviour_logprobs[-1] == pytest.approx(rollout.token_logprobs[-1], abs=1e-5)  # the peer's EOS
        # the digits are single tokens on both sides: their projected logprobs are the peer's exactly
        peer_ids = rollout.completion_token_ids[:-1]
        for k, tok in enumerate(peer_ids):
            piece = bpe_tokenizer.decode([tok])
            if piece.isdigit():
                char_index = len(bpe_tokenizer.decode(peer_ids[:k]))
                assert out.behaviour_logprobs[char_index] == pytest.approx(rollout.token_logprobs[k], abs=1e-6)
        # without the peer's tokenizer: uniform per character, same sum, only when opted in
        uniform = retokenize_peer_rollout(rollout, char_tokenizer, "tok-char", 64, peer_tokenizer=None,
                                          uniform_projection=True)
        assert uniform.projection == "uniform"
        assert uniform.behaviour_logprobs[:-1] == pytest.approx([rollout.logprob_sum / len(text)] * len(text), abs=1e-5)
        with pytest.raises(ValueError, match="graft.peer_tokenizers"):
            retokenize_peer_rollout(rollout, char_tokenizer, "tok-char", 64, peer_tokenizer=None)


def test_char_peer_onto_bpe_learner_preserves_logprob_sum(make_group, char_tokenizer, char_model, bpe_tokenizer):
    group = make_group(PROBLEM, TEXTS, [1.0, 0.0, 1.0, 0.0], char_tokenizer, char_model, model_id="peer", tokenizer_id="tok-char")
    for rollout in group.rollouts:
        out = retokenize_peer_rollout(rollout, bpe_tokenizer, "tok-bpe", 64, peer_tokenizer=char_tokenizer)
        assert out.token_ids[:-1] == bpe_tokenizer(rollout.completion_text, add_special_tokens=False)["input_ids"]
        assert sum(out.behaviour_logprobs[: out.num_content_tokens]) == pytest.approx(rollout.logprob_sum, abs=1e-4)


def test_same_tokenizer_reproduces_stored_ids_and_copies_logprobs(make_group, bpe_tokenizer, bpe_model):
    group = make_group(PROBLEM, TEXTS, [1.0, 0.0, 0.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    for rollout in group.rollouts:
        out = retokenize_peer_rollout(rollout, bpe_tokenizer, "tok-bpe", 64)
        assert out.projection == "exact"
        assert out.token_ids == list(rollout.completion_token_ids)  # content + the same EOS
        assert out.token_ids[:-1] == bpe_tokenizer(rollout.completion_text, add_special_tokens=False)["input_ids"]
        assert out.behaviour_logprobs == list(rollout.token_logprobs)


def test_same_tokenizer_non_canonical_split_keeps_the_stored_ids_and_says_so(make_group, bpe_tokenizer, bpe_model):
    """docs/algorithm.md section 3: with the same tokenizer, re-tokenising must reproduce the stored ids. A sampler may choose a
    split the canonical encoding would not: then the stored ids (whose probabilities are known) are kept, and the
    mismatch is reported."""
    group = make_group(PROBLEM, ["\\boxed{19}"], [1.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    canonical = group.rollouts[0]
    out = retokenize_peer_rollout(canonical, bpe_tokenizer, "tok-bpe", 64)
    assert out.canonical and out.projection == "exact"
    split = bpe_tokenizer("\\b", add_special_tokens=False)["input_ids"] + bpe_tokenizer("oxed{19}", add_special_tokens=False)["input_ids"]
    assert split != canonical.completion_token_ids[:-1]
    ids = split + [bpe_tokenizer.eos_token_id]
    logprobs = [-0.5] * len(ids)
    sampled = Rollout.model_validate(canonical.model_dump() | {
        "completion_token_ids": ids, "token_logprobs": logprobs, "num_tokens": len(ids), "logprob_sum": sum(logprobs[:-1])})
    out = retokenize_peer_rollout(sampled, bpe_tokenizer, "tok-bpe", 64)
    assert not out.canonical and out.projection == "exact"
    assert out.token_ids == ids and out.behaviour_logprobs == logprobs


def test_peer_ids_that_do_not_decode_with_the_mapped_tokenizer_are_dropped(make_group, bpe_tokenizer, bpe_model,
                                                                           char_tokenizer):
    """A tokenizer mapped to the wrong id (or a damaged row): the stored ids do not give the stored text, so no
    span projection exists; the row is dropped (counted), not silently projected uniformly."""
    group = make_group(PROBLEM, ["\\boxed{19}"], [1.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    rollout = group.rollouts[0]
    assert retokenize_peer_rollout(rollout, bpe_tokenizer, "tok-other", 64, peer_tokenizer=char_tokenizer) == "peer_decode"
    opted_in = retokenize_peer_rollout(rollout, bpe_tokenizer, "tok-other", 64, peer_tokenizer=char_tokenizer,
                                       uniform_projection=True)
    assert opted_in.projection == "uniform"


def test_learner_stop_token_is_the_chat_turns_end_when_sampling_stops_there(char_tokenizer):
    """A chat learner ends its turns with the template's end-of-turn token (Qwen's <|im_end|>), not eos_token_id."""
    from toy.world import learner_tokenizer

    tokenizer = learner_tokenizer()  # a fresh one: the session's fixture stays as it is
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.eos_token_id
    assert learner_stop_token(tokenizer, {eos, im_end}, "auto") == im_end
    assert learner_stop_token(tokenizer, {eos, im_end}, "chat") == im_end
    assert learner_stop_token(tokenizer, {eos, im_end}, "raw") == eos  # no chat template in the prompt
    assert learner_stop_token(tokenizer, {eos}, "auto") == eos  # sampling does not stop on <|im_end|>
    assert learner_stop_token(char_tokenizer, {char_tokenizer.eos_token_id}, "auto") == char_tokenizer.eos_token_id


def test_grafted_rows_end_with_the_learners_stop_token(make_group, bpe_tokenizer, bpe_model, char_tokenizer):
    group = make_group(PROBLEM, ["\\boxed{19}"], [1.0], bpe_tokenizer, bpe_model, model_id="peer", tokenizer_id="tok-bpe")
    stop = char_tokenizer.convert_tokens_to_ids("+")  # any id other than the EOS stands for an end-of-turn token
    out = retokenize_peer_rollout(group.rollouts[0], char_tokenizer, "tok-char", 64, bpe_tokenizer, stop_token_id=stop)
    assert out.token_ids[-1] == stop and out.num_content_tokens == len(out.token_ids) - 1


def test_eos_appended_only_when_the_peer_stopped(make_group, bpe_tokenizer, bpe_model, char_tokenizer):
    group = make_group(PROBLEM, TEXTS, [1.0, 0.0, 0.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer",
                       tokenizer_id="tok-bpe", finished=False)
    out = retokenize_peer_rollout(group.rollouts[3], char_tokenizer, "tok-char", 64, peer_tokenizer=bpe_tokenizer)
    assert out.token_ids == char_tokenizer("\\boxed{1", add_special_tokens=False)["input_ids"]
    assert out.num_content_tokens == len(out.token_ids)
    assert sum(out.behaviour_logprobs) == pytest.approx(group.rollouts[3].logprob_sum, abs=1e-4)


def test_drops_round_trip_overlength_and_non_finite(make_group, bpe_tokenizer, bpe_model, char_tokenizer):
    group = make_group(PROBLEM, ["\\boxed{19}", "\\boxed{é}"], [1.0, 0.0], bpe_tokenizer, bpe_model, model_id="peer",
                       tokenizer_id="tok-bpe")
    good, unknown_char = group.rollouts
    # 'é' is not in the character vocabulary: it encodes to <unk> and does not decode back
    assert retokenize_peer_rollout(unknown_char, char_tokenizer, "tok-char", 64, bpe_tokenizer) == "round_trip"
    # 10 characters + EOS = 11 tokens: over a limit of 10, never truncated
    assert retokenize_peer_rollout(good, char_tokenizer, "tok-char", 10, bpe_tokenizer) == "overlength"
    assert isinstance(retokenize_peer_rollout(good, char_tokenizer, "tok-char", 11, bpe_tokenizer), PeerTokens)
    broken = Rollout.model_construct(**(good.model_dump() | {"token_logprobs": [float("nan")] * good.num_tokens}))
    assert retokenize_peer_rollout(broken, char_tokenizer, "tok-char", 64, bpe_tokenizer) == "non_finite"
