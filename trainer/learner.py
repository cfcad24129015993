"""The policy being trained: its weights, tokenizer and identities, the frozen reference, and the sampler
that draws its rollouts (transformers on the policy object itself, or a vLLM engine fed the new weights
after every update)."""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollouts.hf_backend import HFBackend
from rollouts.models import (
    default_model_id,
    eos_token_ids,
    load_model_and_tokenizer,
    model_fingerprint,
    resolve_model_dir,
    tokenizer_fingerprint,
)
from trainer.config import TrainConfig
from trainer.retokenize import learner_stop_token


@dataclass
class Learner:
    """The policy being trained and the identities its groups carry."""

    model: torch.nn.Module
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

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for forward passes (sampling, pi_old, the update's forward and loss); backward runs outside."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    @property
    def end_token_id(self) -> int:
        """The token a completion the learner trains on ends with (its stop token, else its EOS)."""
        return self.tokenizer.eos_token_id if self.stop_token_id is None else self.stop_token_id


def load_learner(cfg: TrainConfig, checkpoint: Path | None) -> Learner:
    """The policy from `checkpoint` (a resumed run) or cfg.model.path, in eval mode on its device."""
    # float32 master weights whatever the compute dtype (mixed precision through Learner.autocast)
    model, tokenizer = load_model_and_tokenizer(checkpoint or cfg.model.path, dtype=torch.float32)
    device = _resolve_device(cfg.model.device)
    # Dropout off: the policy that samples must be the one whose logprobs are trained on.
    model.to(device).eval()
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {cfg.model.path} has no eos_token; set one in its tokenizer_config.json")
    eos_ids = eos_token_ids(model, tokenizer)
    return Learner(
        model=model,
        tokenizer=tokenizer,
        model_id=cfg.model.model_id or default_model_id(cfg.model.path),
        tokenizer_id=cfg.model.tokenizer_id or tokenizer_fingerprint(tokenizer),
        revision=cfg.model.revision or model_fingerprint(resolve_model_dir(cfg.model.path)),
        eos_ids=eos_ids,
        device=device,
        compute_dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype],
        stop_token_id=learner_stop_token(tokenizer, eos_ids, cfg.data.prompt_template),
    )


def load_reference(cfg: TrainConfig, learner: Learner) -> torch.nn.Module | None:
    """The initial policy, frozen, for the KL term (None when ppo.kl_beta is 0). Loaded from the start checkpoint,
    also on resume; frozen, it needs no float32 master copy and is kept in the compute dtype."""
    if cfg.ppo.kl_beta <= 0:
        return None
    return load_learner(cfg, None).model.requires_grad_(False).to(learner.compute_dtype)


def make_sampler(cfg: TrainConfig, learner: Learner, weights_path: str | Path) -> tuple[Any, bool]:
    """The learner's sampler and whether it is a vLLM engine (which needs `sync_sampler` after each update)."""
    on_gpu = learner.device.type == "cuda"
    use_vllm = cfg.rollout.backend == "vllm" or (
        cfg.rollout.backend == "auto" and on_gpu and importlib.util.find_spec("vllm") is not None
    )
    if use_vllm:
        from trainer.vllm_sync import make_vllm_backend

        return make_vllm_backend(cfg, learner, weights_path), True
    backend = HFBackend(learner.model, learner.tokenizer, learner.model_id, tokenizer_id=learner.tokenizer_id,
                        batch_size=cfg.rollout.generation_batch_size)
    return backend, False


def sync_sampler(sampler: Any, learner: Learner) -> None:
    """Give a vLLM engine the updated weights, so that it samples the next step from the new policy."""
    from trainer.vllm_sync import sync_weights

    sync_weights(sampler, learner.model)


def _resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)
