"""Tokenizers trained locally, so the cross-tokenizer path of GRAFT runs for real (no download).

- character level (one token per character) with a fusing decoder (without it, decoding puts a space
  between every pair of characters): the learners;
- byte-level BPE, digits split one by one by default (a prototype of the toy world found: multi-digit number tokens made 3-digit
  addition hard to learn): the peers. The demo's peer trains only on characters the learner's tokenizer
  also has (`allowed_chars`), so every peer completion can be re-tokenised by the learner.
Both come as `PreTrainedTokenizerFast` with eos and pad tokens.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAR_SPECIALS = ("<pad>", "<eos>", "<unk>")
BPE_PAD, BPE_EOS = "<|pad|>", "<|endoftext|>"


def build_char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """One token per character of `chars` plus <pad>, <eos>, <unk>; decode fuses the characters back."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars {chars!r} repeats a character")
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS)} | {c: len(CHAR_SPECIALS) + i for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_bpe_tokenizer(
    corpus: list[str],
    vocab_size: int,
    *,
    allowed_chars: str | None = None,
    all_bytes: bool = False,
    split_digits: bool = True,
    split_words: bool = False,
    bos_token: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus` with <|pad|> and <|endoftext|> (EOS).

    allowed_chars: raise if the corpus holds another character (a learner could not re-tokenise text made
    of it). all_bytes: all 256 bytes in the vocabulary, so any text round-trips. split_digits: digits are
    single tokens. split_words: GPT-2's regex splits words and spaces before the BPE (as real models do).
    bos_token and chat_template: a chat model's (the prompt templates' "chat" path).
    """
    if allowed_chars is not None:
        allowed = set(allowed_chars)
        for text in corpus:
            extra = set(text) - allowed
            if extra:
                raise ValueError(f"corpus text {text!r} has characters {sorted(extra)} that the learner's tokenizer lacks")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) if split_digits else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    specials = [BPE_PAD, BPE_EOS] + ([bos_token] if bos_token else [])
    alphabet = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()} if all_bytes else {}
    tok.train_from_iterator(
        corpus, trainer=trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False, **alphabet)
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=BPE_PAD, eos_token=BPE_EOS, **({"bos_token": bos_token} if bos_token else {})
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
