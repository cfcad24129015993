"""The toy world every test uses (`toy/`: the addition task, tiny tokenizers and models), as fixtures.
Built locally, nothing downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from toy.models import build_tiny_model  # noqa: E402
from toy.task import sample_problems, write_problems_jsonl  # noqa: E402
from toy.world import build_group, cached_chat_model, learner_tokenizer, peer_tokenizer  # noqa: E402



@pytest.fixture(scope="session")
def one_torch_thread():
    """Tiny models run fastest on one thread (and the machine is shared); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory, one_torch_thread):
    """Learner, peer, problems and a store root holding the peer's groups (`toy.world.build_toy_world`)."""
    from toy.world import build_toy_world

    return build_toy_world(tmp_path_factory.mktemp("toy_world"))


@pytest.fixture(scope="session")
def char_tokenizer():
    return learner_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return peer_tokenizer()


@pytest.fixture(scope="session")
def char_model(char_tokenizer):
    return build_tiny_model(char_tokenizer, "llama", seed=1).eval()


@pytest.fixture(scope="session")
def bpe_model(bpe_tokenizer):
    return build_tiny_model(bpe_tokenizer, "qwen2", seed=2).eval()


@pytest.fixture
def make_group():
    return build_group


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The chat model of the generator's and evaluation's tests (`toy.world.cached_chat_model`)."""
    return cached_chat_model()


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_dir):
    from rollouts.hf_backend import HFBackend

    return HFBackend.from_path(tiny_model_dir)


@pytest.fixture()
def toy_dataset(tmp_path) -> Path:
    """12 problems as a JSONL dataset (its stem, `toy`, is the dataset name)."""
    return write_problems_jsonl(sample_problems(12, seed=7), tmp_path / "toy.jsonl")
