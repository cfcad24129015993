"""The verl tests run in verl's own environment (.venv-verl: `make install-verl`); in the project's .venv they skip.
`make test` runs them there with GRAFT_REQUIRE_VERL=1, under which a missing verl fails the run instead of skipping it.

The fixtures the step tests share (one Ray session for them all): verl's TransferQueue with its default 8 storage units,
verl's reward loop (the learner's reward of grafted rows), the toy world and its store."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray on loopback for the tests: no token written to ~/.ray
STORAGE_UNITS = 8  # verl's default (transfer_queue.backend.SimpleStorage.num_data_storage_units)


def pytest_configure(config):
    if os.environ.get("GRAFT_REQUIRE_VERL") and importlib.util.find_spec("verl") is None:
        raise pytest.UsageError("GRAFT_REQUIRE_VERL is set but verl is not importable: run these tests with "
                                ".venv-verl/bin/python (make install-verl builds it)")


@pytest.fixture(scope="session")
def transfer_queue():
    """verl's TransferQueue on loopback Ray with verl's default storage units (one Ray CPU each: logical CPUs)."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=STORAGE_UNITS + 6, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": STORAGE_UNITS}}}))
    yield tq
    tq.close()
    ray.shutdown()


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """The learner (a chat-templated toy Llama), a peer with its own BPE, the problems and the learner's plans."""
    from verl_world import build_world

    return build_world(tmp_path_factory.mktemp("verl"))


@pytest.fixture(scope="session")
def store(world):
    from graft.services.store_api.http.testing import StoreServer

    with StoreServer(world["store_root"]) as server:
        yield server


@pytest.fixture(scope="session")
def learner(world):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(world["learner_dir"]).eval()


@pytest.fixture(scope="session")
def reward_loop(world, transfer_queue):
    """verl's RewardLoopManager of the tests' config, as verl's trainer builds it in `_setup` (its Ray reward worker,
    its naive reward manager, verl's default scorers chosen by each row's data_source)."""
    from verl.experimental.reward_loop import RewardLoopManager
    from verl_world import graft_overrides, verl_config

    return RewardLoopManager(config=verl_config(graft_overrides(world["learner_dir"], None, None)))
