"""The served backend's faults, against a stub completions server on loopback (the real server's answers are
tests/generator/test_generate_openai.py's): a 429 is tried again and the run stores everything; a timeout, a cut
answer, fewer than G choices, logprobs of another length than the ids, ids outside the tokenizer, an answer without
token ids, one for another prompt than the one sent and one that is not JSON each end `graft-generate` with one line saying what to do, and nothing stored.
The API key travels from the environment to the server and nowhere else."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from graft.rollouts.openai_backend import OpenAIBackend, OpenAIBackendConfig, ServerError, server_root
from graft.rollouts.sampling import SamplingParams
from graft.schemas import table_to_groups
from graft.services.generator.cli import app as generate_app
from graft.services.generator.config import GeneratorConfig

COMPLETION_IDS = [40, 41, 42]  # a completion the stub "samples": ids inside the tiny tokenizer's 315


class _QuietServer(ThreadingHTTPServer):
    """Room for every connection the backend opens at once; a client that hung up on a slow answer is no error."""

    request_queue_size = 64
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass


class StubServer:
    """A completions server that answers POST /v1/completions as `script` says, one entry per request (the last one
    repeats): 'ok' (n well-formed choices), or a fault by name. It records every request's JSON body and headers."""

    def __init__(self, script: list[str]):
        self.script = list(script)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._send(200, json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append(body)
                    stub.headers.append(dict(self.headers))
                    behaviour = stub.script.pop(0) if len(stub.script) > 1 else stub.script[0]
                stub.answer(self, behaviour, body)

            def _send(self, status: int, payload: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, handler, behaviour: str, body: dict) -> None:
        n = body.get("n", 1)
        if body.get("prompt_logprobs") is not None:  # the logprobs-mode check's teacher forcing
            if behaviour == "no_prompt_logprobs":
                return handler._send(400, b'{"error": {"message": "prompt_logprobs is not supported"}}')
            # a raw-mode server: the teacher-forced logprobs are the sampled ones (-0.5 each); one that samples with
            # settings of its own: they differ
            forced = -0.3 if behaviour == "own_settings" else -0.5
            entries = [None] + [{str(t): {"logprob": forced, "rank": 1}} for t in body["prompt"][1:]]
            return handler._send(200, json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [1],
                                                               "prompt_logprobs": entries, "finish_reason": "length",
                                                               "logprobs": None}]}).encode())
        choices = [{"index": i, "text": "x", "token_ids": list(COMPLETION_IDS), "finish_reason": "length",
                    "logprobs": {"token_logprobs": [-0.5] * len(COMPLETION_IDS), "tokens": ["a"] * len(COMPLETION_IDS)}}
                   for i in range(n)]
        if behaviour == "too_many_requests":
            return handler._send(429, b'{"error": {"message": "rate limited"}}', {"Retry-After": "0"})
        if behaviour == "slow":
            time.sleep(1.5)  # past the test's timeout_s
        if behaviour == "cut":  # a Content-Length the body never reaches, then the connection closes
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", "4096")
            handler.end_headers()
            handler.wfile.write(b'{"choices": [{"index": 0, "tok')
            handler.close_connection = True
            return None
        if behaviour == "not_json":
            return handler._send(200, b"<html>502 Bad Gateway</html>")
        if behaviour == "fewer_choices":
            choices = choices[:-1]
        elif behaviour == "short_logprobs":
            choices[0]["logprobs"]["token_logprobs"] = [-0.5]
        elif behaviour == "bad_ids":
            choices[1]["token_ids"] = [40, 99999, 42]
        elif behaviour == "other_prompt":  # a server that re-tokenised or added a BOS
            for choice in choices:
                choice["prompt_token_ids"] = [2, *body["prompt"]]
        elif behaviour == "no_token_ids":
            for choice in choices:
                del choice["token_ids"]
        elif behaviour == "no_top_k":
            return handler._send(400, b'{"error": {"message": "Unrecognized request argument supplied: top_k"}}')
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n * len(COMPLETION_IDS)}
        return handler._send(200, json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": choices,
                                              "usage": usage}).encode())

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def stub():
    servers: list[StubServer] = []

    def start(*script: str) -> StubServer:
        servers.append(StubServer(list(script)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _generate(tiny_model_dir: Path, dataset: Path, store: Path, url: str, *sets: str):
    """graft-generate --backend openai in this process, quick retries; (exit code, stdout, stderr)."""
    args = ["--backend", "openai", "--model", str(tiny_model_dir), "--model-id", "served", "--dataset", str(dataset),
            "--store", str(store), "--set", f"sampler.base_url={url}", "--set", "sampler.max_retries=2",
            "--set", "sampler.backoff_s=0.01", "--set", "sampler.timeout_s=0.5", "--set", "group_size=4",
            "--set", "max_tokens=3", "--set", "prompt.template=raw", "--set", "scoring.workers=1", "--set", "progress=false",
            *[item for s in sets for item in ("--set", s)]]
    result = CliRunner().invoke(generate_app, args)
    return result.exit_code, result.stdout, result.stderr


def test_a_429_is_tried_again_and_the_run_stores_every_group(stub, tiny_model_dir, toy_dataset, tmp_path):
    server = stub("too_many_requests", "ok")
    code, out, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "store", server.url, "seed=3")
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["groups"] == 12 and summary["rollouts"] == 48
    # the model list, 12 prompts, one of them twice, and the check of one sample (T = 1: nothing unstated applied)
    assert summary["server"]["requests"] == 15 and summary["server"]["retries"] == 1
    assert summary["server"]["completion_tokens"] == 48 * len(COMPLETION_IDS)
    assert len(list((tmp_path / "store" / "rollouts").rglob("part-*.parquet"))) == 1
    samples = [body for body in server.requests if "prompt_logprobs" not in body]
    sent = samples[-1]
    assert (sent["n"], sent["max_tokens"], sent["logprobs"], sent["return_token_ids"]) == (4, 3, 0, True)
    assert sent["model"] == "stub" and all(isinstance(t, int) for t in sent["prompt"])
    assert len({r["seed"] for r in samples[1:]}) == 12  # one seed a prompt, as the vllm backend seeds


@pytest.mark.parametrize("behaviour, message", [
    ("slow", "ReadTimeout: timed out; still failing after 2 retries"),
    ("cut", "still failing after 2 retries"),
    ("fewer_choices", "asked for n = 4 samples of prompt"),
    ("short_logprobs", "has 3 token ids but 1 logprobs"),
    ("bad_ids", "holds token id 99999, outside the tokenizer's 315 tokens"),
    ("no_token_ids", "has no 'token_ids': the server ignored return_token_ids"),
    ("not_json", "the answer is not JSON"),
    ("other_prompt", "ran another prompt than the token ids sent"),
])
def test_a_bad_answer_stops_the_run_in_one_line_and_stores_nothing(stub, tiny_model_dir, toy_dataset, tmp_path,
                                                                   behaviour, message):
    server = stub(behaviour)
    code, out, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "store", server.url)
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "\n" not in lines[0]
    assert list((tmp_path / "store").rglob("*.parquet")) == []


def test_a_server_without_top_k_is_named(stub, tiny_model_dir, toy_dataset, tmp_path):
    """Every request states top_k (-1: no cut), so a server without vLLM's extensions refuses every one: named."""
    server = stub("no_top_k")
    code, _, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "store", server.url)
    assert code == 2 and "the server does not take top_k (a vLLM extension" in err and "serve the peer with vLLM" in err
    assert len(server.requests) <= 12  # a refusal is final: not tried again


def test_every_request_states_every_sampling_setting(stub, tiny_model_dir, toy_dataset, tmp_path):
    """A vLLM server fills each sampling field a request leaves unset from the model folder's generation_config.json:
    every request states them all (no top-k, min-p nor penalty unless asked) and stops on the peer's EOS ids."""
    from graft.rollouts.models import generation_eos_ids, load_tokenizer_of

    eos = sorted(generation_eos_ids(tiny_model_dir, load_tokenizer_of(tiny_model_dir)))
    for sampling, stated in ((("temperature=1.0",), {"temperature": 1.0, "top_p": 1.0, "top_k": -1}),
                             (("temperature=0.7", "top_p=0.9", "top_k=20"), {"temperature": 0.7, "top_p": 0.9, "top_k": 20}),
                             (("temperature=0",), {"temperature": 0.0, "top_p": 1.0, "top_k": -1})):
        server = stub("ok")
        code, _, err = _generate(tiny_model_dir, toy_dataset, tmp_path / str(sampling), server.url, *sampling,
                                 "sampler.logprobs_mode=raw_logprobs")
        assert code == 0, err
        for body in server.requests:  # the samples' requests and the check's teacher forcing alike
            assert {k: body[k] for k in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                                         "stop_token_ids")} == {"min_p": 0.0, "repetition_penalty": 1.0,
                                                                "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                                                "stop_token_ids": eos}, body
        samples = [body for body in server.requests if "prompt_logprobs" not in body]
        assert len(samples) == 12 and all({k: body[k] for k in stated} == stated and body["max_tokens"] == 3
                                          for body in samples), samples[0]


def test_a_server_that_samples_with_settings_of_its_own_is_refused_at_t_1(stub, tiny_model_dir, toy_dataset, tmp_path):
    """At T = 1 without truncation the sampled logprobs are the model's own whatever the logprobs mode: a server whose
    numbers differ from its teacher-forced ones applied settings the request did not state (a generation config, or
    fields it ignores). Refused in one line, nothing stored; the same check passes a server that does not."""
    code, _, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "store", stub("own_settings").url)
    assert code == 2 and "applies sampling settings the request does not state" in err, err
    assert len(err.strip().splitlines()) == 1 and list((tmp_path / "store").rglob("*.parquet")) == []
    server = stub("ok")
    code, _, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "ok", server.url)
    assert code == 0 and sum("prompt_logprobs" in body for body in server.requests) == 1, err


def test_the_stated_logprobs_mode_is_checked_where_the_server_scores_prompts(stub, tiny_model_dir, toy_dataset,
                                                                             tmp_path, caplog):
    """The stub's logprobs are its teacher-forced ones: a raw-mode server. At T = 0.7 that contradicts the default
    statement (processed_logprobs); a server that scores no prompts leaves it unchecked, said in the log."""
    server = stub("ok")
    code, _, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "store", server.url, "temperature=0.7")
    assert code == 2 and "sampler.logprobs_mode says processed_logprobs" in err and "it runs raw_logprobs" in err, err
    assert list((tmp_path / "store").rglob("*.parquet")) == []
    code, _, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "raw", server.url, "temperature=0.7",
                             "sampler.logprobs_mode=raw_logprobs")
    assert code == 0, err
    rows = [r for g in _groups(tmp_path / "raw") for r in g.rollouts]
    assert len(rows) == 48 and {r.logprobs_mode for r in rows} == {"raw"}
    server = stub("no_prompt_logprobs")
    code, _, err = _generate(tiny_model_dir, toy_dataset, tmp_path / "unchecked", server.url, "temperature=0.7")
    assert code == 0, err
    assert "sampler.logprobs_mode and the sampling the server applies are unchecked" in caplog.text


def _groups(store: Path):
    return [g for shard in (store / "rollouts").rglob("part-*.parquet") for g in table_to_groups(pq.read_table(shard))]


def test_the_api_key_comes_from_the_environment_and_is_stored_nowhere(stub, tiny_model_dir, monkeypatch, tmp_path):
    server = stub("ok")
    config = OpenAIBackendConfig(base_url=server.url + "/v1/", api_key_env="GRAFT_TEST_KEY")
    with pytest.raises(ServerError, match="GRAFT_TEST_KEY, which is not set"):
        OpenAIBackend.from_path(tiny_model_dir, config)
    monkeypatch.setenv("GRAFT_TEST_KEY", "sk-secret-123")
    backend = OpenAIBackend.from_path(tiny_model_dir, config)
    try:
        groups = backend.generate(["1+1=", "2+3="], SamplingParams(n=2, max_tokens=3))
    finally:
        backend.close()
    assert [len(g) for g in groups] == [2, 2] and groups[0][0].token_ids == COMPLETION_IDS
    assert {h["Authorization"] for h in server.headers} == {"Bearer sk-secret-123"}
    dumped = GeneratorConfig(model="m", dataset="d", store="s", sampler=config).model_dump_json()
    assert "sk-secret" not in dumped and "GRAFT_TEST_KEY" in dumped


def test_the_progress_line_hears_of_each_prompt_as_its_samples_come_back(stub, tiny_model_dir):
    """A served batch can take minutes: `on_tokens` is told (tokens so far, at most that many) as each prompt's samples
    come back, the budget shrinking by what a prompt's samples left unused, as the hf backend tells it per step."""
    server = stub("ok")
    backend = OpenAIBackend.from_path(tiny_model_dir, OpenAIBackendConfig(base_url=server.url, concurrency=1,
                                                                          check_logprobs_mode=False))
    told = []
    backend.on_tokens = lambda sampled, budget: told.append((sampled, budget))
    try:
        backend.generate(["1+1=", "2+3=", "4+4="], SamplingParams(n=2, max_tokens=8))
    finally:
        backend.close()
    per_prompt = 2 * len(COMPLETION_IDS)
    assert told == [(per_prompt, per_prompt + 2 * 2 * 8), (2 * per_prompt, 2 * per_prompt + 2 * 8),
                    (3 * per_prompt, 3 * per_prompt)]


def test_the_configuration_says_what_backend_openai_needs(tmp_path):
    with pytest.raises(ValueError, match="sampler.base_url=http://HOST:PORT"):
        GeneratorConfig(model="m", dataset="d", store="s", sampler={"backend": "openai"})
    served = {"backend": "openai", "base_url": "http://h:1"}
    with pytest.raises(ValueError, match="drop watch_dir"):
        GeneratorConfig(model="m", dataset="d", store="s", sampler=served, continuous=True, watch_dir="w")
    with pytest.raises(ValueError, match="sampler.batch_size with sampler.backend openai: not a setting of that backend"):
        GeneratorConfig(model="m", dataset="d", store="s", sampler={**served, "batch_size": 8})
    assert server_root("http://h:8000/v1/") == server_root("http://h:8000") == "http://h:8000"
    # raw logprobs are other rows: another key; the default leaves earlier runs' keys as they were
    base = {"model": "m", "dataset": "d", "store": "s"}
    assert GeneratorConfig(**base, sampler=served).sampling_key() == GeneratorConfig(**base).sampling_key()
    raw = GeneratorConfig(**base, sampler={**served, "logprobs_mode": "raw_logprobs"})
    assert raw.sampling_key() != GeneratorConfig(**base, sampler=served).sampling_key()
    shown = yaml.safe_load(yaml.safe_dump(raw.model_dump(mode="json")))
    assert shown["sampler"] == {**raw.sampler.model_dump(), "backend": "openai", "logprobs_mode": "raw_logprobs"}


def test_dry_run_checks_the_server(stub, tiny_model_dir, toy_dataset, tmp_path):
    server = stub("ok")
    base = ["--backend", "openai", "--model", str(tiny_model_dir), "--dataset", str(toy_dataset), "--store",
            str(tmp_path / "s"), "--dry-run"]
    result = CliRunner().invoke(generate_app, [*base, "--set", f"sampler.base_url={server.url}"])
    assert result.exit_code == 0, result.stderr
    result = CliRunner().invoke(generate_app, [*base, "--set", f"sampler.base_url={server.url}",
                                               "--set", "sampler.served_model=other"])
    assert result.exit_code == 2 and "serves stub, not other" in result.stderr
    result = CliRunner().invoke(generate_app, [*base, "--set", "sampler.base_url=http://127.0.0.1:9"])
    assert result.exit_code == 2 and "does not answer (ConnectError): start the server" in result.stderr
