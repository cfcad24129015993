"""Tiny tokenizers, models and rollout groups for the trainer's tests (built locally, no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

from trainer.testing import build_bpe_tokenizer, build_char_tokenizer, build_group, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models run fastest on one thread (and the machine is shared); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory, one_torch_thread):
    """Learner, peer, problems and a store root holding the peer's groups (trainer.testing.build_toy_world)."""
    from trainer.testing import build_toy_world

    return build_toy_world(tmp_path_factory.mktemp("toy_world"))


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return build_bpe_tokenizer()


@pytest.fixture(scope="session")
def char_model(char_tokenizer):
    return build_tiny_model(char_tokenizer, "llama", seed=1).eval()


@pytest.fixture(scope="session")
def bpe_model(bpe_tokenizer):
    return build_tiny_model(bpe_tokenizer, "qwen2", seed=2).eval()


@pytest.fixture
def make_group():
    return build_group
