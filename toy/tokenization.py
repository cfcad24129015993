"""Two tokenizers trained locally, so the cross-tokenizer path of GRAFT runs for real.

- learner: character level (one token per character) with a fusing decoder (without it, decoding
  puts a space between every pair of characters).
- peer: byte-level BPE, digits split one by one (TOY_STUDY: multi-digit number tokens made 3-digit
  addition hard to learn), trained only on characters the learner's tokenizer also has, so every
  peer completion can be re-tokenised by the learner.
Both are saved as `PreTrainedTokenizerFast` with eos and pad tokens.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAR_SPECIALS = ("<pad>", "<eos>", "<unk>")
BPE_SPECIALS = ("<|pad|>", "<|endoftext|>")


def build_char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """One token per character of `chars` plus <pad>, <eos>, <unk>; decode fuses the characters back."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars {chars!r} repeats a character")
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS)} | {c: len(CHAR_SPECIALS) + i for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_bpe_tokenizer(corpus: list[str], allowed_chars: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus`, digits kept as single tokens.

    Raises if the corpus holds a character outside `allowed_chars` (the learner could not re-tokenise
    text made of it)."""
    allowed = set(allowed_chars)
    for text in corpus:
        extra = set(text) - allowed
        if extra:
            raise ValueError(f"corpus text {text!r} has characters {sorted(extra)} that the learner's tokenizer lacks")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>")
