"""The policy being trained: its weights, tokenizer and identities, the frozen reference, and the sampler
that draws its rollouts (transformers on the policy object itself, or a vLLM engine fed the new weights
after every update). Data parallel (graft.trainer.distributed): the policy is wrapped for the strategy (DDP,
or FSDP2-sharded) on the rank's device; under fsdp the transformers sampler gathers the full weights for
each generate call."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graft.rollouts.hf_backend import HFBackend
from graft.rollouts.models import (
    default_model_id,
    eos_token_ids,
    load_model_and_tokenizer,
    model_fingerprint,
    resolve_model_dir,
    tokenizer_fingerprint,
)
from graft.rollouts.sampling import ProgressCallback
from graft.trainer.config import TrainConfig
from graft.trainer.distributed import DistContext, gathered_weights, wrap_model, wrap_reference
from graft.trainer.retokenize import learner_stop_token


@dataclass
class Learner:
    """The policy being trained and the identities its groups carry.

    Two handles on the one policy: a forward whose output is backpropagated calls `grad_model` (under ddp the
    wrapper, whose backward all-reduces the gradients: through `hf_model` the ranks would step apart); everything
    else (sampling, no-grad passes, the vLLM sync, the optimizer's parameters) takes `hf_model`, the transformers
    model itself, whose generate() and forwards need no DDP machinery. Under fsdp and in one process they are
    the same object."""

    hf_model: torch.nn.Module  # the transformers model (under fsdp sharded in place): sampling, no-grad passes
    tokenizer: Any
    model_id: str
    tokenizer_id: str
    revision: str
    eos_ids: set[int]
    device: torch.device
    compute_dtype: torch.dtype = torch.float32  # forward passes run in it; the parameters stay float32
    # the token its own rollouts end with (retokenize.learner_stop_token), which grafted and anchor rows end with
    # too; None: the tokenizer's EOS
    stop_token_id: int | None = None
    dist: DistContext | None = None  # this process's place in the job (None: one process, on `device`)
    # what every forward that is backpropagated calls (the update's, the anchor's), and what checkpoints save: the
    # DDP wrapper or, under fsdp and in one process, hf_model itself
    grad_model: torch.nn.Module | None = None
    # rollout.hf_sampler_copy: the policy in the compute dtype, which the hf sampler samples from (refreshed after each
    # update by `sync_sampler_copy`); None: the sampler samples hf_model under autocast
    sampler_model: torch.nn.Module | None = None

    def __post_init__(self) -> None:
        if self.dist is None:
            self.dist = DistContext("none", self.device)
        if self.grad_model is None:
            self.grad_model = self.hf_model

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for forward passes (sampling, pi_old, the update's forward and loss); backward runs outside."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def sampling_autocast(self) -> contextlib.AbstractContextManager:
        """What the sampler's calls run under: autocast over the float32 policy, or nothing for a copy in the compute
        dtype (autocast around it would only slow it down)."""
        return contextlib.nullcontext() if self.sampler_model is not None else self.autocast()

    def sync_sampler_copy(self) -> None:
        """Copy the updated float32 weights into the sampler's copy (rollout.hf_sampler_copy), cast."""
        with torch.no_grad():
            for copy, weight in zip(self.sampler_model.parameters(), self.hf_model.parameters(), strict=True):
                copy.copy_(weight)

    @property
    def end_token_id(self) -> int:
        """The token a completion the learner trains on ends with (its stop token, else its EOS)."""
        return self.tokenizer.eos_token_id if self.stop_token_id is None else self.stop_token_id


def load_learner(cfg: TrainConfig, checkpoint: Path | None, dist: DistContext | None = None) -> Learner:
    """The policy from `checkpoint` (a resumed run) or cfg.model.path, in eval mode on its device; data parallel:
    wrapped for dist.strategy (ddp: every rank loads the same weights; fsdp: rank 0 loads them, the others build
    the model on the meta device and receive their shards). Build the optimizer after this (FSDP replaces the
    parameters by their shards)."""
    dist = dist or DistContext("none", _resolve_device(cfg.model.device))
    # float32 master weights whatever the compute dtype (mixed precision through Learner.autocast); under fsdp only
    # rank 0 reads them, the other ranks receive their shards (wrap_model)
    model, tokenizer = load_model_and_tokenizer(checkpoint or cfg.model.path, dtype=torch.float32,
                                                meta=dist.strategy == "fsdp" and not dist.is_main)
    compute_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    # Dropout off: the policy that samples must be the one whose logprobs are trained on.
    model.eval()
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {cfg.model.path} has no eos_token; set one in its tokenizer_config.json")
    eos_ids = eos_token_ids(model, tokenizer)
    grad_model = wrap_model(model, dist, compute_dtype)  # one process: the model, moved to its device
    return Learner(
        hf_model=model,
        tokenizer=tokenizer,
        **learner_identity(cfg, tokenizer),
        eos_ids=eos_ids,
        device=dist.device,
        compute_dtype=compute_dtype,
        stop_token_id=learner_stop_token(tokenizer, eos_ids, cfg.prompt.template),
        dist=dist,
        grad_model=grad_model,
    )


def learner_model_id(cfg: TrainConfig) -> str:
    """The model id the learner's groups carry in the store: model.model_id, else the name of model.path."""
    return cfg.model.model_id or default_model_id(cfg.model.path)


def learner_identity(cfg: TrainConfig, tokenizer: Any) -> dict[str, str]:
    """The ids the learner's groups carry, as `Learner` takes them (graft-train's and the host trainers' alike): its
    model id, its tokenizer's id (model.tokenizer_id, else the fingerprint the generator stores) and its revision
    (model.revision, else the fingerprint of the initial checkpoint; a hub name that is no local path: the name)."""
    path = Path(cfg.model.path).expanduser()
    revision = cfg.model.revision or (model_fingerprint(resolve_model_dir(path)) if path.exists() else cfg.model.path)
    return {"model_id": learner_model_id(cfg), "tokenizer_id": cfg.model.tokenizer_id or tokenizer_fingerprint(tokenizer),
            "revision": revision}


def load_reference(cfg: TrainConfig, learner: Learner) -> torch.nn.Module | None:
    """The initial policy, frozen, for the KL term (None when ppo.kl_beta is 0). Loaded from the start checkpoint,
    also on resume; frozen, it needs no float32 master copy and is kept in the compute dtype (under fsdp sharded like
    the policy)."""
    if cfg.ppo.kl_beta <= 0:
        return None
    dist = learner.dist
    model, _ = load_model_and_tokenizer(cfg.model.path, dtype=torch.float32, meta=dist.strategy == "fsdp" and not dist.is_main)
    return wrap_reference(model.eval().requires_grad_(False).to(learner.compute_dtype), dist)


def make_sampler(cfg: TrainConfig, learner: Learner, weights_path: str | Path) -> tuple[Any, bool]:
    """The learner's sampler and whether it is a vLLM engine (which needs `sync_sampler` after each update)."""
    on_gpu = learner.device.type == "cuda"
    use_vllm = cfg.rollout.backend == "vllm" or (
        cfg.rollout.backend == "auto" and on_gpu and importlib.util.find_spec("vllm") is not None
    )
    if use_vllm:
        from graft.trainer.vllm_sync import make_vllm_backend

        return make_vllm_backend(cfg, learner, weights_path), True
    if cfg.rollout.hf_sampler_copy:
        learner.sampler_model = copy.deepcopy(learner.hf_model).to(learner.compute_dtype).requires_grad_(False).eval()
    backend = HFBackend(learner.sampler_model or learner.hf_model, learner.tokenizer, learner.model_id,
                        tokenizer_id=learner.tokenizer_id, batch_size=cfg.rollout.generation_batch_size)
    return (GatheredSampler(backend) if learner.dist.strategy == "fsdp" else backend), False


class GatheredSampler:
    """The transformers sampler over an FSDP2-sharded policy: each generate call runs with the full weights
    gathered on every rank (graft.trainer.distributed.gathered_weights), so that its forwards, whose number depends on
    the rank's prompts, need no collective. Every rank calls generate together, with no prompts too."""

    def __init__(self, backend: HFBackend):
        self.backend = backend

    def generate(self, prompts, params):
        with gathered_weights(self.backend.model):
            return self.backend.generate(prompts, params)

    @property
    def on_tokens(self) -> ProgressCallback | None:
        return self.backend.on_tokens

    @on_tokens.setter
    def on_tokens(self, report: ProgressCallback | None) -> None:  # the progress line: the backend's
        self.backend.on_tokens = report

    def __getattr__(self, name: str) -> Any:  # tokenizer, model_id, eos_token_ids, ...: the backend's
        return getattr(self.backend, name)


@contextlib.contextmanager
def whole_weights(sampler: Any) -> Iterator[Any]:
    """A sampler whose generate calls need no collective for the duration: under fsdp, the transformers backend
    with the full weights gathered once on entry (every rank enters together); any other sampler as it is."""
    if not isinstance(sampler, GatheredSampler):
        yield sampler
        return
    with gathered_weights(sampler.backend.model):
        yield sampler.backend


def sync_sampler(sampler: Any, learner: Learner) -> None:
    """Give a vLLM engine the updated weights, so that it samples the next step from the new policy."""
    from graft.trainer.vllm_sync import sync_weights

    sync_weights(sampler, learner.hf_model)


def _resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)
