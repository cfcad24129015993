"""Loading a saved tokenizer tokenises as it was saved.

transformers 5 loads any directory whose config says qwen2 with Qwen2Tokenizer, which replaces the saved
normalizer and pre-tokenizer with Qwen's (NFC, regex split). A Qwen2-style model with a locally trained BPE
whose pre-tokenizer differs (whitespace split, digits one by one) would silently get other token ids.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from graft.rollouts.models import TOKENIZER_PROBE, load_model_and_tokenizer, load_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
TEXTS = [
    TOKENIZER_PROBE,
    "12+34=46 so the answer is \\boxed{46}",
    "Natalia sold 48 clips in April, and half as many in May.  How many in all?\n",
    "  leading spaces,\ttabs\nand 1234567 digits",
]


def _qwen2_with_local_bpe(out_dir):
    """A tiny Qwen2 model directory whose BPE splits on whitespace and keeps digits apart (not Qwen's regex)."""
    corpus = [f"{a}+{b}={a + b} so the answer is \\boxed{{{a + b}}}. Natalia sold clips in April and May, how many?"
              for a in range(60) for b in range(0, 60, 7)]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)])
    bpe.decoder = decoders.BPEDecoder()
    bpe.train_from_iterator(corpus, trainer=trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|pad|>", "<|endoftext|>"],
                                                                show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<|pad|>", eos_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def test_qwen2_directory_with_a_local_bpe_tokenises_as_saved(tmp_path, caplog):
    model_dir = _qwen2_with_local_bpe(tmp_path / "qwen2-local-bpe")
    saved = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [saved.encode(text, add_special_tokens=False).ids for text in TEXTS]

    # The hazard itself: AutoTokenizer alone gives other ids for this directory.
    auto = AutoTokenizer.from_pretrained(model_dir)
    assert [auto(text, add_special_tokens=False)["input_ids"] for text in TEXTS] != expected, (
        f"{type(auto).__name__} now keeps the saved pre-tokenizer: load_tokenizer's fallback is no longer exercised here"
    )

    with caplog.at_level(logging.WARNING, logger="graft.rollouts.models"):
        model, tokenizer = load_model_and_tokenizer(model_dir)
    assert model.config.model_type == "qwen2"
    assert [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS] == expected
    warnings = [r.getMessage() for r in caplog.records if r.name == "graft.rollouts.models"]
    assert len(warnings) == 1 and "tokenizer.json" in warnings[0] and ("pre-tokenizer" in warnings[0] or "normalizer" in warnings[0])
    # What the rest of the code reads from the tokenizer survives the fallback.
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == ("<|endoftext|>", "<|pad|>", "<unk>")
    assert tokenizer.eos_token_id == saved.token_to_id("<|endoftext|>") == model.config.eos_token_id
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.get_vocab() == saved.get_vocab(with_added_tokens=True)


def test_faithful_tokenizers_load_unchanged(tiny_model_dir, caplog):
    # The generator tests' Llama directory (byte-level BPE) loads as AutoTokenizer loads it, without a warning.
    with caplog.at_level(logging.WARNING, logger="graft.rollouts.models"):
        tokenizer = load_tokenizer(tiny_model_dir)
    assert not [r for r in caplog.records if r.name == "graft.rollouts.models"]
    assert type(tokenizer) is type(AutoTokenizer.from_pretrained(tiny_model_dir))
    saved = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in TEXTS:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == saved.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("component", ["normalizer", "pre_tokenizer"])
def test_a_changed_component_alone_is_noticed(tmp_path, component):
    # Even when the probe text happens to encode alike, a different normalizer or pre-tokenizer is a difference.
    from tokenizers import normalizers

    from graft.rollouts.models import tokenisation_difference

    saved = Tokenizer.from_file(str(_qwen2_with_local_bpe(tmp_path / "m") / "tokenizer.json"))
    assert tokenisation_difference(saved, Tokenizer.from_str(saved.to_str())) is None
    changed = Tokenizer.from_str(saved.to_str())
    if component == "normalizer":
        changed.normalizer = normalizers.NFKC()
    else:
        changed.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tokenisation_difference(changed, saved) == component.replace("_", "-")
