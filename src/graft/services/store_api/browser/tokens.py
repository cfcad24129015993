"""Token text for the browser: the store keeps token ids, not token strings, so it decodes them with the model's
tokenizer when it has one (`graft-store serve --tokenizer DIR`, matched by fingerprint to a row's tokenizer_id).

A token's piece is the text it adds to the decoded completion: decode(ids[s:i+1]) minus decode(ids[s:i]) over a
window of WINDOW tokens, so that SentencePiece's leading spaces and byte-level BPE's merged characters come out as
in the whole text. A token that ends inside a multi-byte character adds '' and the token completing it carries the
character (with whatever the unfinished tokens held before it, a space say). Without the tokenizer there are no pieces, and the browser says so instead of guessing.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("graft.store")

WINDOW = 8  # tokens of left context per piece: longer than any character's bytes (4) and any merge's context
REPLACEMENT = "\ufffd"  # what decoding yields for the bytes of an unfinished UTF-8 character


def token_pieces(tokenizer: Any, ids: list[int]) -> tuple[list[str], list[bool]]:
    """(piece of text per token, whether each token is special); "".join(pieces) is the whole decoded text."""
    starts = [max(0, i - WINDOW) for i in range(len(ids))]
    options = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    with_token = tokenizer.batch_decode([ids[s : i + 1] for i, s in enumerate(starts)], **options)
    before = tokenizer.batch_decode([ids[s:i] for i, s in enumerate(starts)], **options)
    pieces = []
    deferred = None  # the first token of a character not yet complete
    for i, (text, prefix) in enumerate(zip(with_token, before)):
        if text.endswith(REPLACEMENT):  # inside a character: the token that completes it shows it
            pieces.append("")
            deferred = i if deferred is None else deferred
            continue
        if deferred is not None:  # this token completes it: its piece is everything after the last piece shown
            prefix = tokenizer.decode(ids[starts[i] : deferred], **options)
            deferred = None
        pieces.append(text[len(prefix):] if text.startswith(prefix) else tokenizer.decode([ids[i]], **options))
    special = set(tokenizer.all_special_ids)
    return pieces, [i in special for i in ids]


class TokenizerShelf:
    """The tokenizers of `paths` (model paths as the generator takes them) by fingerprint, loaded at first use."""

    def __init__(self, paths: list[Path]):
        missing = [str(p) for p in paths if not Path(p).exists()]
        if missing:
            raise ValueError(f"tokenizers: {', '.join(missing)} does not exist; pass the model paths the generators "
                             "loaded (HF model or tokenizer directories, or GGUF files)")
        self.paths = [Path(p) for p in paths]
        self._lock = threading.Lock()
        self._by_id: dict[str, tuple[Any, Path]] | None = None
        self._failures: list[str] = []

    def load_in_background(self) -> None:
        """Start loading now (transformers' import and the files take seconds), so the first view does not wait."""
        if self.paths:
            threading.Thread(target=self._load, name="store-tokenizers", daemon=True).start()

    def _load(self) -> dict[str, tuple[Any, Path]]:
        with self._lock:
            if self._by_id is None:
                # the generator's own loader and fingerprint: the ids it stored are the ones these decode
                from graft.rollouts.models import load_tokenizer_of, tokenizer_fingerprint

                found: dict[str, tuple[Any, Path]] = {}
                for path in self.paths:
                    try:
                        tokenizer = load_tokenizer_of(path)
                    except (OSError, ValueError) as exc:
                        self._failures.append(f"{path}: {exc}")
                        log.error("tokenizer in %s could not be loaded: %s", path, exc)
                        continue
                    found[tokenizer_fingerprint(tokenizer)] = (tokenizer, path)
                    log.info("browser decodes %s with the tokenizer of %s", tokenizer_fingerprint(tokenizer), path)
                self._by_id = found
            return self._by_id

    def find(self, tokenizer_id: str) -> tuple[Any | None, str]:
        """(the tokenizer with this fingerprint or None, a sentence saying what the pieces are or why there are none)"""
        if not self.paths:
            return None, (f"token text not shown: the store has no tokenizers (start it with --tokenizer DIR, the "
                          f"model's directory, to decode {tokenizer_id}); ids and probabilities are the stored ones")
        by_id = self._load()
        if tokenizer_id in by_id:
            return by_id[tokenizer_id][0], f"decoded with the tokenizer of {by_id[tokenizer_id][1]}"
        known = ", ".join(f"{p.name} ({f})" for f, (_, p) in sorted(by_id.items())) or "none loaded"
        failed = f"; could not load: {'; '.join(self._failures)}" if self._failures else ""
        return None, (f"token text not shown: no tokenizer with fingerprint {tokenizer_id} among the store's "
                      f"--tokenizer directories ({known}{failed}); ids and probabilities are the stored ones")
