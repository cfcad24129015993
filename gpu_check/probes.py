"""The two parts of `make gpu-check` (gpu_check/check.py) that touch CUDA from Python directly, each run
as its own process so that the check's driver never holds the GPU:

    python -m gpu_check.probes cuda OUT_JSON [--no-vllm]
        torch and vLLM versions, the NVIDIA driver's version, the GPU's name and memory, bf16 support.
    python -m gpu_check.probes sync MODEL_DIR OUT_JSON --dtype bfloat16 --device cuda
        the trainer's in-process vLLM engine (graft.trainer.vllm_sync) samples; the policy's weights are changed;
        sync_weights copies them into the engine; its logprobs must then follow the changed policy (a
        teacher-forced float32 forward pass), where before the sync they followed the old one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

SYNC_PROBLEMS = [
    "What is 12 + 7?",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "A box holds 6 eggs. How many eggs are in 4 boxes?",
    "What is 45 minus 18?",
]


def driver_version() -> str | None:
    """The NVIDIA driver's version (580.95.05, ...): from nvidia-smi, else the kernel module's own line."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    version_file = Path("/proc/driver/nvidia/version")  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05 ..."
    if version_file.exists():
        words = version_file.read_text().split()
        return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), None)
    return None


def probe_cuda(with_vllm: bool = True) -> dict:
    info: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "driver": driver_version(),
                  "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(devices=torch.cuda.device_count(), name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    bf16=torch.cuda.is_bf16_supported())
    if not with_vllm:
        return info
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError as error:  # reported, not raised: the check says which package is missing
        info["vllm_error"] = f"{type(error).__name__}: {error}"
    return info


def probe_sync(model_dir: str, dtype: str, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from graft.rollouts.hf_backend import teacher_forced_logprobs
    from graft.rollouts.models import load_tokenizer
    from graft.rollouts.prompts import build_prompt
    from graft.rollouts.sampling import SamplingParams
    from graft.trainer.vllm_sync import check_weight_sync, start_vllm_backend

    tokenizer = load_tokenizer(model_dir)
    # The policy as the trainer keeps it: float32 master weights on the device.
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    backend = start_vllm_backend(model_dir, "sync-probe", "sync-probe", seed=0, max_model_len=2048,
                                 gpu_memory_utilization=0.2, dtype=dtype)
    prompts = [build_prompt(tokenizer, problem, "auto") for problem in SYNC_PROBLEMS]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=48, seed=0)

    @torch.no_grad()
    def mean_gap(groups) -> float:
        """Mean |engine logprob - policy logprob| over every sampled token."""
        gaps = []
        for ids, group in zip(prompt_ids, groups, strict=True):
            for sample in group:
                reference = teacher_forced_logprobs(policy, ids, sample.token_ids, params)
                gaps += [abs(a - b) for a, b in zip(reference, sample.token_logprobs, strict=True)]
        return sum(gaps) / max(len(gaps), 1)

    generator = torch.Generator(device=device).manual_seed(0)

    def perturb(model) -> None:  # a large "update" of every matrix, 20% of its own spread: the policy changes visibly
        for parameter in model.parameters():
            if parameter.dim() == 2:
                noise = torch.randn(parameter.shape, generator=generator, device=device)
                parameter.add_(noise * 0.2 * parameter.std())

    result, after = check_weight_sync(backend, policy, prompts, params, mean_gap, perturb)
    result.update(tokens=sum(len(s.token_ids) for g in after for s in g), dtype=dtype)
    backend.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="probe", required=True)
    cuda = sub.add_parser("cuda")
    cuda.add_argument("out", type=Path)
    cuda.add_argument("--no-vllm", action="store_true", help="do not import vLLM (the offline form has none)")
    sync = sub.add_parser("sync")
    sync.add_argument("model_dir")
    sync.add_argument("out", type=Path)
    sync.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    sync.add_argument("--device", default="cuda")
    args = parser.parse_args()
    result = probe_cuda(not args.no_vllm) if args.probe == "cuda" else probe_sync(args.model_dir, args.dtype, args.device)
    args.out.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
