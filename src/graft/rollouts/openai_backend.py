"""Sampling from a model behind an OpenAI-compatible completions server (vLLM's first), by URL.

One `POST {base_url}/v1/completions` per prompt: the prompt as token ids of the peer's tokenizer (loaded locally,
as the other backends load it), `n` = G, `logprobs: 0` (the sampled token's logprob) and `return_token_ids: true`
(vLLM's extension: the completion's token ids), so that a stored row holds exactly the tokens the server sampled
and their behaviour logprobs, as the in-process backends' rows do. Every request states every sampling setting a
vLLM server would otherwise take from the model folder's generation_config.json (its default `--generation-config
auto`: top_k, min_p, the repetition, presence and frequency penalties, temperature, top_p, max_tokens) and the
peer's EOS ids as `stop_token_ids`, as the in-process vLLM backend does (`sampling_fields`): the rows say what was
sampled. Requests run `concurrency` at a time; 429, 5xx,
timeouts and broken connections are tried again with a doubling pause, `max_retries` times at most. Any other
failure, or an answer that is not G well-formed choices (the wrong count, logprobs of another length than the
token ids, ids outside the tokenizer, a missing field, not JSON), fails the whole call in one line (`ServerError`):
the generator stores a batch whole or not at all.

What the logprobs are is the server's setting (vLLM's `--logprobs-mode`), which no endpoint reports: the config
states it (`logprobs_mode`) and the rows record it. The first call checks what the server did against its own
teacher-forced logprobs of one sample (vLLM's `prompt_logprobs`, which no sampling setting processes): where the
sampling makes the modes differ (a temperature other than 0 and 1, top-p or top-k), a processed-mode server gives
other numbers than those and a raw-mode one the same, which checks the statement; where it changes nothing
(temperature 1 or greedy, no truncation), both modes give the same numbers, and a server whose numbers differ
applies sampling settings the request did not state (a generation config it does not let a request override, or
fields it ignores): it is refused in one line, since its rows would say one sampling and hold another.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import Field, model_validator

from graft.rollouts.models import default_model_id, generation_eos_ids, load_tokenizer_of, tokenizer_fingerprint
from graft.rollouts.sampling import ProgressCallback, Sample, SamplingParams
from graft.schemas.rollout import LOGPROB_TOLERANCE
from graft.schemas.sections import KindSection

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0  # the longest pause before a retry (a 429's Retry-After included)
# The logprobs-mode check compares a sample's logprobs with the server's teacher-forced (raw) ones of its tokens:
MODE_CHECK_GAP = 0.02  # a token whose two logprobs differ by more: the server's are processed
MODE_CHECK_NOISE = 1e-3  # every token within this (two forward passes of float32 weights agree to ~1e-5): raw ...
MODE_CHECK_UNSURE = -0.1  # ... provided MODE_CHECK_MIN_TOKENS tokens have a raw logprob below this, where the
MODE_CHECK_MIN_TOKENS = 2  # processed one would differ; near-certain tokens have about 0 in both modes
MODE_CHECK_TRIES = 3  # calls without a conclusion (near-certain samples, float noise) before the check gives up
ANSWER_EXCERPT = 200  # characters of a bad answer quoted in an error
# the sampling fields of vLLM's completions API beyond OpenAI's, which every request states (sampling_fields)
VLLM_SAMPLING_FIELDS = ("top_k", "min_p", "repetition_penalty", "stop_token_ids")


class OpenAIBackendConfig(KindSection):
    """The `openai` backend: a completions server by URL (`graft-generate --backend openai`, `graft-eval`): the
    `sampler` section's settings when sampler.backend is openai."""

    backend: Literal["openai"] = "openai"
    base_url: str | None = Field(default=None, description="openai: the server's root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted); required")
    served_model: str | None = Field(default=None, description="openai: the model name the server serves (vLLM's --served-model-name; default: the server's only model, from GET /v1/models)")
    api_key_env: str | None = Field(default=None, description="openai: name of the environment variable holding the API key, sent as a bearer token (the key itself is never stored)")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        default="processed_logprobs", description="openai: what the server's sampled-token logprobs are (vLLM's --logprobs-mode): processed_logprobs, the behaviour policy after temperature/top-p/top-k; raw_logprobs, the model's own; rows record it")
    check_logprobs_mode: bool = Field(default=True, description="openai: check, on the first calls, the server's logprobs of one sample against its teacher-forced ones (vLLM's prompt_logprobs): that logprobs_mode holds where the sampling makes the modes differ, and that the server applies no sampling setting the request does not state where it changes nothing (T = 1 or greedy, no top-p/top-k)")
    concurrency: int = Field(default=8, ge=1, description="openai: requests in flight at once (one per prompt, n = G samples each)")
    timeout_s: float = Field(default=600.0, gt=0, description="openai: one request's limit, connecting and reading")
    max_retries: int = Field(default=5, ge=0, description="openai: tries after the first for a request answered 429 or 5xx, timed out or cut off; then the call fails and nothing of its batch is stored")
    backoff_s: float = Field(default=1.0, gt=0, description=f"openai: pause before the first retry, doubled before each next one (at most {MAX_BACKOFF_S:.0f} s; a 429's Retry-After is honoured up to that)")

    @model_validator(mode="after")
    def _names_a_server(self) -> OpenAIBackendConfig:
        if not self.base_url:
            raise ValueError("backend openai needs the server's URL: --set sampler.base_url=http://HOST:PORT")
        return self

    def api_key(self) -> str | None:
        """The key from the environment variable `api_key_env` names; a clear error when it is not set."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ServerError(f"sampler.api_key_env names {self.api_key_env}, which is not set in this environment: "
                              f"export {self.api_key_env}=<key>, or drop api_key_env for a server without keys")
        return key


class ServerError(RuntimeError):
    """The server failed a request for good, or answered what cannot be stored: one line saying what to do."""


@dataclass
class RequestCounts:
    """What the backend asked of the server (the run summary's `server`)."""

    requests: int = 0  # HTTP requests sent, retries and the logprobs-mode check included
    retries: int = 0  # requests sent again after a 429, 5xx, timeout or broken connection
    prompt_tokens: int = 0  # as the server counts them (its `usage`)
    completion_tokens: int = 0
    generate_s: float = 0.0  # wall time inside generate calls

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "generate_s": round(self.generate_s, 3)}


def server_root(base_url: str) -> str:
    """`base_url` without a trailing slash or `/v1` (OpenAI clients' base URLs end in /v1; we add the paths)."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


class OpenAIBackend:
    """A `Backend` over an OpenAI-compatible completions server."""

    def __init__(self, config: OpenAIBackendConfig, tokenizer, model_id: str, eos_ids: set[int],
                 tokenizer_id: str | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.tokenizer_id = tokenizer_id or tokenizer_fingerprint(tokenizer)
        self.eos_token_ids = eos_ids
        self.logprobs_mode = config.logprobs_mode
        self.counts = RequestCounts()
        self.root = server_root(config.base_url)
        self._vocab_size = len(tokenizer)
        self._lock = threading.Lock()  # counts are updated from the request threads
        self._mode_checks_left = MODE_CHECK_TRIES
        key = config.api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
        self._http = httpx.Client(timeout=config.timeout_s, headers=headers, limits=limits)
        self._pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="openai-backend")
        self.on_tokens: ProgressCallback | None = None  # told as each prompt's samples come back
        self._call_tokens = self._call_budget = 0  # the generate call's tokens so far, and at most that many in all
        self.served_model = config.served_model or self._only_served_model()

    @classmethod
    def from_path(cls, path: str | Path, config: OpenAIBackendConfig, model_id: str | None = None) -> OpenAIBackend:
        """The tokenizer (and EOS ids) of the model at `path` (an HF directory, a tokenizer-only one, or a GGUF):
        the prompt ids sent and the completion ids received are that tokenizer's."""
        tokenizer = load_tokenizer_of(path)
        return cls(config, tokenizer, model_id=model_id or default_model_id(path), eos_ids=generation_eos_ids(path, tokenizer))

    @classmethod
    def from_settings(cls, settings: OpenAIBackendConfig, path: str | Path, *, model_id: str | None = None,
                      seed: int = 0) -> OpenAIBackend:
        """The registered loader (`backends.load_backend`); the server samples (each request's seed comes with its
        SamplingParams)."""
        return cls.from_path(path, settings, model_id=model_id)

    def close(self) -> None:
        """Drop the requests not yet sent; those in flight after a failed call end as the connections close."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def server_counts(self) -> dict[str, float]:
        """What was asked of the server (`RequestCounts`)."""
        return self.counts.as_dict()

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Sample]]:
        if not prompts:
            return []
        started = time.perf_counter()
        prompt_ids = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]  # the chat template holds the specials
            if not ids:
                raise ValueError(f"prompt {i} tokenises to nothing: every prompt needs at least one token")
            prompt_ids.append(ids)
        self._call_tokens, self._call_budget = 0, len(prompts) * params.n * params.max_tokens
        try:
            futures = [self._pool.submit(self._sample_prompt, i, ids, params) for i, ids in enumerate(prompt_ids)]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f in done and f.exception() is not None]
            if failed:
                for future in pending:  # requests not yet sent are dropped; those in flight end on their own
                    future.cancel()
                raise failed[0].exception()
            groups = [future.result() for future in futures]  # (prompts, n)
            if self._mode_checks_left and self.config.check_logprobs_mode:
                self._check_logprobs_mode(prompt_ids, groups, params)
            return groups
        finally:
            with self._lock:
                self.counts.generate_s += time.perf_counter() - started

    def _sample_prompt(self, index: int, prompt_ids: list[int], params: SamplingParams) -> list[Sample]:
        body: dict[str, Any] = {"model": self.served_model, "prompt": prompt_ids, "n": params.n,
                                **self.sampling_fields(params), "logprobs": 0, "return_token_ids": True}
        if params.seed is not None:
            # as the vllm backend seeds its requests: the n samples of a request draw from seed, seed + 1, ...
            body["seed"] = params.sample_seed(index, 0)
        answer = self._request("POST", "/v1/completions", body, f"prompt {index}")
        samples = self._parse_choices(answer, params.n, prompt_ids, f"prompt {index}")
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        sampled = sum(len(s.token_ids) for s in samples)
        with self._lock:
            self.counts.prompt_tokens += int(usage.get("prompt_tokens") or len(prompt_ids))
            self.counts.completion_tokens += int(usage.get("completion_tokens") or sampled)
            self._call_tokens += sampled
            self._call_budget -= params.n * params.max_tokens - sampled  # a prompt whose samples stopped early
            if self.on_tokens is not None:
                self.on_tokens(self._call_tokens, self._call_budget)
        return samples

    def _parse_choices(self, answer: dict, n: int, prompt_ids: list[int], what: str) -> list[Sample]:
        """The n samples of one answer, each checked: every failure is a one-line ServerError."""
        choices = answer.get("choices")
        if not isinstance(choices, list):
            raise ServerError(f"{self.root}: the answer for {what} has no 'choices' list: {_excerpt(answer)}")
        if len(choices) != n:
            raise ServerError(f"{self.root}: asked for n = {n} samples of {what}, got {len(choices)} choices: the server "
                              "must honour n (a group is stored whole or not at all); check its limits on n")
        by_index = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        samples = []
        for position, choice in enumerate(by_index):
            where = f"{what}, choice {position}"
            if not isinstance(choice, dict):
                raise ServerError(f"{self.root}: {where} is not an object: {_excerpt(choice)}")
            if choice.get("prompt_token_ids") not in (None, prompt_ids):  # vLLM echoes the prompt it ran
                raise ServerError(f"{self.root}: {where} ran another prompt than the token ids sent (a server that "
                                  "re-tokenises or adds tokens): its samples do not continue the stored prompt")
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise ServerError(
                    f"{self.root}: {where} has no 'token_ids': the server ignored return_token_ids (a vLLM extension, "
                    "which vLLM's OpenAI server honours); serve the peer with vLLM, or store its traces without token "
                    "ids another way")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") if isinstance(choice.get("logprobs"), dict) else None
            if logprobs is None:
                raise ServerError(f"{self.root}: {where} has no 'logprobs.token_logprobs': the server ignored logprobs: 0; "
                                  "a server that gives no sampled-token logprobs cannot fill behaviour logprobs")
            if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ServerError(f"{self.root}: {where}: token_ids is not a list of integers: {_excerpt(token_ids)}")
            if len(logprobs) != len(token_ids):
                raise ServerError(f"{self.root}: {where} has {len(token_ids)} token ids but {len(logprobs)} logprobs: "
                                  "each sampled token needs its one logprob")
            outside = [t for t in token_ids if not 0 <= t < self._vocab_size]
            if outside:
                raise ServerError(f"{self.root}: {where} holds token id {outside[0]}, outside the tokenizer's "
                                  f"{self._vocab_size} tokens: the server runs a model with another tokenizer than the "
                                  "one loaded here (--model names the served model's folder)")
            bad = [lp for lp in logprobs if isinstance(lp, bool) or not isinstance(lp, (int, float))
                   or not math.isfinite(lp) or lp > LOGPROB_TOLERANCE]
            if bad:
                raise ServerError(f"{self.root}: {where} has the logprob {bad[0]!r}: a sampled token's logprob is a finite "
                                  "number <= 0 (a value of -9999 is vLLM's -inf: a token outside the sampled support)")
            finish = choice.get("finish_reason")
            if finish not in ("stop", "length"):
                raise ServerError(f"{self.root}: {where} finished with {finish!r}; expected 'stop' or 'length' (an aborted "
                                  "or unfinished sample is not stored)")
            # The text from our tokenizer, as the other backends decode it: the server's `text` may treat special
            # tokens otherwise.
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            samples.append(Sample(token_ids=token_ids, token_logprobs=[float(lp) for lp in logprobs], text=text,
                                  finish_reason=finish))
        return samples

    def sampling_fields(self, params: SamplingParams) -> dict[str, Any]:
        """Every sampling setting of a completions request: what `params` says, and no top-k, min-p nor penalty
        beyond it, stated, so that a vLLM server takes none of them from the model folder's generation_config.json
        (which it does for each field a request leaves unset); the peer's EOS ids as stop_token_ids (the in-process
        vLLM backend's). top_k -1 is "no cut" in every vLLM version (0 in newer ones only)."""
        return {"temperature": params.temperature, "top_p": 1.0 if params.greedy else params.top_p,
                "top_k": -1 if params.greedy else params.effective_top_k or -1, "min_p": 0.0,
                "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "max_tokens": params.max_tokens, "stop_token_ids": sorted(self.eos_token_ids)}

    def _scoring_body(self, ids: list[int]) -> dict[str, Any]:
        """A request for the server's teacher-forced logprobs of `ids` (vLLM's prompt_logprobs; one greedy token
        after them, every sampling setting stated as for a sample)."""
        return {"model": self.served_model, "prompt": ids, **self.sampling_fields(SamplingParams(n=1, temperature=0.0,
                max_tokens=1)), "prompt_logprobs": 0}

    def _check_logprobs_mode(self, prompt_ids: list[list[int]], groups: list[list[Sample]], params: SamplingParams) -> None:
        """Compare one sample's logprobs with the server's teacher-forced ones of the same tokens (`prompt_logprobs`,
        which no sampling setting processes). Where `params` make the modes differ, equal means the server runs
        raw_logprobs and different processed_logprobs; where they change nothing, both modes give the teacher-forced
        numbers, and different ones mean the server applied sampling settings the request did not state. The sample
        with the lowest logprob sum is checked (the one with the most uncertain tokens, where any of it shows most)."""
        i, j = min(((i, j) for i, group in enumerate(groups) for j in range(len(group))),
                   key=lambda ij: sum(groups[ij[0]][ij[1]].token_logprobs))
        sample = groups[i][j]
        body = self._scoring_body(prompt_ids[i] + sample.token_ids)
        try:
            answer = self._request("POST", "/v1/completions", body, "the logprobs-mode check")
        except ServerError as error:
            log.warning("%s: sampler.logprobs_mode and the sampling the server applies are unchecked, it scored no prompt "
                        "(%s): the rows say %s, as stated", self.root, error, self.logprobs_mode)
            self._mode_checks_left = 0
            return
        teacher = _prompt_logprobs_of(answer, prompt_ids[i] + sample.token_ids)
        if teacher is None:
            log.warning("%s: the server gave no prompt_logprobs (a vLLM extension), so sampler.logprobs_mode and the "
                        "sampling it applies are unchecked: the rows say %s, as stated", self.root, self.logprobs_mode)
            self._mode_checks_left = 0
            return
        completion = teacher[len(prompt_ids[i]):]  # (L,) raw logprobs of the sample's tokens
        gap = max(abs(a - b) for a, b in zip(completion, sample.token_logprobs, strict=True))
        unsure = sum(lp < MODE_CHECK_UNSURE for lp in completion)
        self._mode_checks_left -= 1
        if gap > MODE_CHECK_GAP and not _modes_differ(params):
            self._mode_checks_left = 0
            raise ServerError(
                f"{self.root}: asked to sample at temperature {params.temperature:g} with no top-p, top-k, min-p or "
                f"penalty, where every logprob is the model's own, the server gave logprobs that differ from its "
                f"teacher-forced ones by up to {gap:.3g} over {len(completion)} tokens: it applies sampling settings the "
                "request does not state (a generation_config.json it does not let requests override, or fields it "
                "ignores), so rows would say one sampling and hold another. Serve the peer with vLLM (which honours "
                "every field sent), or start it with --generation-config vllm")
        if gap > MODE_CHECK_GAP:
            seen = "processed_logprobs"
        elif gap <= MODE_CHECK_NOISE and unsure >= MODE_CHECK_MIN_TOKENS:
            seen = "raw_logprobs"
        else:
            if not self._mode_checks_left:
                log.warning("%s: sampler.logprobs_mode is unchecked (the samples checked were near-certain, where the "
                            "modes agree, or their gap %.3g was in between): the rows say %s, as stated", self.root,
                            gap, self.logprobs_mode)
            return  # the next call's samples are checked
        self._mode_checks_left = 0
        if seen != self.logprobs_mode and _modes_differ(params):
            raise ServerError(
                f"{self.root}: sampler.logprobs_mode says {self.logprobs_mode} but the server's sampled-token logprobs "
                f"{'equal' if seen == 'raw_logprobs' else 'differ from'} its teacher-forced (raw) ones (largest gap "
                f"{gap:.3g} over {len(completion)} tokens): it runs {seen}. Start vLLM with --logprobs-mode "
                f"{self.logprobs_mode}, or set sampler.logprobs_mode={seen} (rows then say so)")

    def teacher_forced_logprobs(self, prompt_ids: list[int], completions: list[list[int]]) -> list[list[float]]:
        """The server's logprob of each completion token after the prompt and the tokens before it (vLLM's
        `prompt_logprobs` of prompt + completion, `max_tokens` 1): the model's own, temperature-1 distribution, as
        vLLM never temperature-processes prompt logprobs. One request per completion, `concurrency` in flight; a
        server that gives no prompt_logprobs (not vLLM) raises ServerError."""
        def one(ids: list[int]) -> list[float]:
            answer = self._request("POST", "/v1/completions", self._scoring_body(prompt_ids + ids), "rescoring")
            teacher = _prompt_logprobs_of(answer, prompt_ids + ids)
            if teacher is None:
                raise ServerError(f"{self.root} gave no prompt_logprobs for {len(prompt_ids) + len(ids)} tokens (a vLLM "
                                  "extension): rescore with a vLLM server, or in-process (--backend hf)")
            return teacher[len(prompt_ids):]

        return list(self._pool.map(one, completions))

    def _only_served_model(self) -> str:
        """The one model GET /v1/models lists; otherwise a line asking for sampler.served_model."""
        names = _model_names(self._request("GET", "/v1/models", None, "the model list"))
        if len(names) != 1:
            raise ServerError(f"{self.root} serves {len(names)} models ({', '.join(map(str, names)) or 'none listed'}): "
                              "name one with --set sampler.served_model=NAME")
        return names[0]

    def _request(self, method: str, path: str, body: dict | None, what: str) -> dict:
        """The JSON answer of one request, tried again after 429, 5xx, timeouts and broken connections."""
        url = self.root + path
        for attempt in range(self.config.max_retries + 1):
            with self._lock:
                self.counts.requests += 1
                self.counts.retries += attempt > 0
            retry_after = None
            try:
                response = self._http.request(method, url, json=body)
            except httpx.TransportError as error:  # timeouts, refused or cut connections, a cut answer
                failure = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            else:
                if response.status_code < 400:
                    return _json_of(response, url, what)
                if response.status_code != 429 and response.status_code < 500:
                    raise ServerError(_refusal(response, url, what, body))
                failure = f"HTTP {response.status_code}: {_error_message(response)}"
                retry_after = _seconds(response.headers.get("retry-after"))
            if attempt == self.config.max_retries:
                raise ServerError(f"{url} ({what}): {failure}; still failing after {attempt} retries: the server is down "
                                  "or overloaded (lower sampler.concurrency, raise sampler.max_retries or sampler.timeout_s)")
            pause = min(MAX_BACKOFF_S, retry_after if retry_after is not None else self.config.backoff_s * 2**attempt)
            log.warning("%s (%s): %s; retry %d of %d in %.1f s", url, what, failure, attempt + 1, self.config.max_retries, pause)
            time.sleep(pause)
        raise AssertionError("unreachable")


def list_served_models(config: OpenAIBackendConfig) -> list[str]:
    """The model names the server's GET /v1/models lists, in one try of at most 10 s (`graft-generate --dry-run`'s
    check); ServerError saying what to do when it does not answer."""
    url = server_root(config.base_url or "") + "/v1/models"
    key = config.api_key()
    try:
        response = httpx.get(url, headers={"Authorization": f"Bearer {key}"} if key else {},
                             timeout=min(config.timeout_s, 10.0))
    except httpx.TransportError as error:
        raise ServerError(f"{url} does not answer ({type(error).__name__}): start the server, or fix sampler.base_url") from None
    if response.status_code >= 400:
        raise ServerError(_refusal(response, url, "the model list", None))
    return _model_names(_json_of(response, url, "the model list"))


def _model_names(answer: dict) -> list[str]:
    """The ids of an OpenAI model list ({"data": [{"id": ...}, ...]})."""
    data = answer.get("data")
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else []


def _modes_differ(params: SamplingParams) -> bool:
    """Whether processed and raw logprobs differ under `params` (greedy decoding reports the raw ones in both), with
    no min-p nor penalty (sampling_fields states none)."""
    return not params.greedy and not params.model_distribution


def _prompt_logprobs_of(answer: dict, ids: list[int]) -> list[float] | None:
    """The logprob of each of `ids` after the ones before it (the first: 0.0), from vLLM's `prompt_logprobs`
    (a list: None, then {token id: {logprob, rank, decoded_token}} per position); None when absent or malformed."""
    choices = answer.get("choices")
    entries = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        return None
    out = [0.0]
    for token, entry in zip(ids[1:], entries[1:]):
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or not isinstance(found.get("logprob"), (int, float)):
            return None
        out.append(float(found["logprob"]))
    return out


def _json_of(response: httpx.Response, url: str, what: str) -> dict:
    try:
        answer = response.json()
    except ValueError:
        raise ServerError(f"{url} ({what}): the answer is not JSON (cut off, or not a completions server?): "
                          f"{response.text[:ANSWER_EXCERPT]!r}") from None
    if not isinstance(answer, dict):
        raise ServerError(f"{url} ({what}): the answer is JSON but not an object: {_excerpt(answer)}")
    return answer


def _refusal(response: httpx.Response, url: str, what: str, body: dict | None) -> str:
    """One line for a 4xx other than 429, saying what to change."""
    message = _error_message(response)
    status = response.status_code
    hint = ""
    if status in (401, 403):
        hint = ": the server wants another API key (sampler.api_key_env names the variable that holds it)"
    elif status == 404:
        hint = (": no such path or model; sampler.base_url is the server's root (http://HOST:PORT) and sampler.served_model "
                "a name from its GET /v1/models")
    elif body is not None and (named := [f for f in VLLM_SAMPLING_FIELDS if f in body and f in message]):
        hint = (f": the server does not take {named[0]} (a vLLM extension, stated in every request so that the rows say "
                "what was sampled): serve the peer with vLLM")
    return f"{url} ({what}) refused with HTTP {status}: {message}{hint}"


def _error_message(response: httpx.Response) -> str:
    """The server's own message: OpenAI's {"error": {"message"}}, vLLM's and FastAPI's variants, or the text."""
    try:
        payload = response.json()
    except ValueError:
        return " ".join(response.text[:ANSWER_EXCERPT].split()) or "(empty answer)"
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message") or error.get("detail") if isinstance(error, dict) else error
    return " ".join(str(message or payload)[:ANSWER_EXCERPT].split())


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the doubling pause instead


def _excerpt(value: object) -> str:
    return " ".join(repr(value)[:ANSWER_EXCERPT].split())
