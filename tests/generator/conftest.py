"""Fixtures of the generator tests: a tiny local model (trained once per session) and toy data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_generator_model import cached_tiny_model, write_toy_dataset  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return cached_tiny_model()


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_dir):
    from rollouts.hf_backend import HFBackend

    return HFBackend.from_path(tiny_model_dir)


@pytest.fixture()
def toy_dataset(tmp_path) -> Path:
    return write_toy_dataset(tmp_path / "toy.jsonl", 12)
