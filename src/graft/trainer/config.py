"""The trainer's configuration: one pydantic model per component, readable from YAML, settable from the CLI.

Every field has a one-line description (shown by `graft-train show-config`). Defaults follow
docs/algorithm.md section 7 (real models on GPU); the toy configs in `configs/` override what they need.
Override any field from the command line with a dotted path: `--set graft.peer_negative_scale=0`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from graft.rollouts.prompts import PromptConfig
from graft.schemas.api import ServeOrder
from graft.schemas.sections import KindSection, Section, refuse_moved

_Section = Section  # every section: a typo in a YAML key fails loudly


class ModelConfig(_Section):
    path: str = Field(description="learner checkpoint: a HF-format directory (or a .gguf file) loaded with load_model_and_tokenizer")
    model_id: str | None = Field(default=None, description="name this learner's groups carry in the store (path-safe); default: the directory or GGUF name")
    tokenizer_id: str | None = Field(default=None, description="id of the learner's tokenizer; peers with the same id take the exact path; default: its fingerprint (as the generator stores it)")
    revision: str | None = Field(default=None, description="revision stored with the learner's groups; default: fingerprint of the initial checkpoint")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="compute dtype of the policy's forward passes (torch.autocast) and of the vLLM sampler; parameters and "
                    "optimizer state stay float32 (master weights: a 1e-6 update of a bfloat16 weight rounds away). "
                    "No float16: it would need loss scaling",
    )
    device: str = Field(default="auto", description="torch device: 'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1', ...")


class DataConfig(_Section):
    dataset: str = Field(description="training problems: a JSONL/Parquet path or a data set name under GRAFT_DATA_DIR (load_problems)")
    limit: int | None = Field(default=None, ge=1, description="use only the first N problems")
    problem_field: str = Field(default="problem", min_length=1, description="the dataset's column holding the problem text (a raw GSM8K file: question)")
    answer_field: str | None = Field(default=None, min_length=1, description="the dataset's column holding the gold answer (default: answer); GSM8K's '... #### 7' is read as 7")
    shuffle: bool = Field(default=True, description="reshuffle the problems every epoch (seeded by `seed`)")

    @model_validator(mode="before")
    @classmethod
    def _prompt_is_a_section(cls, data: Any) -> Any:
        refuse_moved(data, {"prompt_template": "prompt.template", "instruction": "prompt.instruction",
                            "system_prompt": "prompt.system_prompt"}, where="data.")
        return data


class RolloutConfig(_Section):
    backend: Literal["auto", "hf", "vllm"] = Field(default="auto", description="learner sampling: 'hf' on the in-memory policy, 'vllm' with weight sync after each step; auto: vllm on GPU, hf on CPU")
    group_size: int = Field(default=8, ge=2, description="G: rollouts per prompt")
    prompts_per_step: int = Field(default=128, ge=1, description="prompts per training step (the prompt batch)")
    temperature: float = Field(default=1.0, gt=0.0, description="sampling temperature of training rollouts")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus mass of training rollouts")
    top_k: int | None = Field(default=None, ge=1, description="top-k of training rollouts (None: off)")
    max_response_tokens: int = Field(default=4096, ge=1, description="learner's max response length; longer re-tokenised peer texts are dropped")
    generation_batch_size: int = Field(default=64, ge=1, description="prompts per generate() call of the hf backend")
    hf_sampler_copy: bool = Field(
        default=False,
        description="hf backend with model.dtype bfloat16: sample from a bfloat16 copy of the policy, refreshed after "
                    "every update (as the vLLM sampler is), instead of under autocast over the float32 weights: about 1.7x "
                    "faster on a CPU (benchmarks/RESULTS.md), one more copy of the weights in memory; changes what is "
                    "sampled (a bfloat16-rounded policy) while the loss's logprobs stay the trainer's autocast forwards")
    vllm_gpu_memory_utilization: float = Field(default=0.4, gt=0.0, lt=1.0, description="share of GPU memory the vLLM engine may take (the policy and optimizer need the rest)")
    scorer_workers: int = Field(default=2, ge=1, description="math-verify worker processes")
    scorer_timeout_s: float = Field(default=10.0, gt=0.0, description="time limit for scoring one completion")
    seed_per_sample: bool | None = Field(
        default=None,
        description="seed every rollout by its place in the step's global prompt batch (as vLLM seeds requests), so that a "
                    "prompt's rollouts do not depend on which rank samples it: N data-parallel ranks then draw what one process "
                    "with this on draws. None: on under parallel.strategy ddp/fsdp, off with none (the hf backend seeds each "
                    "generate call once, as before; vLLM seeds per request either way)",
    )

    def seeds_per_sample(self, strategy: str) -> bool:
        """seed_per_sample as it applies under parallel.strategy `strategy`."""
        return strategy != "none" if self.seed_per_sample is None else self.seed_per_sample


class OptimConfig(_Section):
    lr: float = Field(default=1e-6, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    adam_eps: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon")
    grad_clip: float | None = Field(default=1.0, gt=0.0, description="clip the global gradient norm to this (None: off)")
    warmup_steps: int = Field(default=0, ge=0, description="linear learning-rate warm-up, in optimizer steps")
    schedule: Literal["constant", "cosine"] = Field(default="constant", description="learning rate after warm-up")
    ppo_epochs: int = Field(default=1, ge=1, description="passes over each step's batch")
    mini_batch_prompts: int = Field(default=64, ge=1, description="prompts (groups) per optimizer step; prompts_per_step / this = updates per epoch")
    micro_batch_size: int = Field(default=64, ge=1, description="sequences per forward/backward (gradient accumulation inside a mini-batch)")
    skip_zero_advantage: bool = Field(default=False, description="no forward/backward for rows with zero advantage (exact when kl_beta = 0: they add no gradient, only count in the normaliser); off: every row is computed, as in standard GRPO trainers")


class PPOConfig(_Section):
    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="PPO clip: ratio >= 1 - eps_low")
    eps_high: float = Field(default=0.28, ge=0.0, description="PPO clip: ratio <= 1 + eps_high")
    dual_clip_c: float | None = Field(default=3.0, gt=1.0, description="dual clip for negative advantages: loss <= -A * c (None: off)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        default="token-mean", description="token-mean (default); seq-mean-token-mean; seq-mean-token-sum-norm = Dr. GRPO constant normaliser"
    )
    advantage: Literal["grpo", "dr_grpo"] = Field(default="grpo", description="grpo: (r - mean) / (std + 1e-6); dr_grpo: r - mean (no std division), for on-policy and grafted groups")
    kl_beta: float = Field(default=0.0, ge=0.0, description="weight of the k3 KL to the initial policy (0: off, no reference model kept)")


# Named sets of the graft fields the spec's formulas name (docs/algorithm.md sections 1, 4-7, 11): graft.preset picks one, and refuses another
# value of any of them beside it (issue 60: `spec` had left is_cap, log_rho_min and group_normalized_weight to the
# defaults, so a config could change the spec's formulas under the spec's name).
# spec: the formulas as first read from the paper (b = min(pi_old / mu~, C = 2), the peer's negative advantages kept, w =
# min(1, rho)^1 with no floor, no group centring, no union, no KL on grafted tokens, at most half a step grafted);
# b1_no_peer_neg: the same but b = 1 and the peer's negative advantages x0 (docs/training.md, "Which GRAFT runs by
# default").
_SPEC_FIELDS: dict[str, Any] = {
    "token_is": "tis", "is_cap": 2.0, "kappa": 1.0, "log_rho_min": None, "peer_negative_scale": 1.0,
    "group_normalized_weight": False, "peer_loss_scale": 1.0, "union_all_success": False, "kl_on_peer": False,
    "max_grafted_fraction": 0.5, "luffy_gamma": 0.1,
}
GRAFT_PRESETS: dict[str, dict[str, Any]] = {
    "spec": _SPEC_FIELDS,
    "b1_no_peer_neg": {**_SPEC_FIELDS, "token_is": "none", "peer_negative_scale": 0.0},
}


# The fields that make GRAFT's loss: which GRAFT a run trains with (the presets' fields and the options that change
# the maths). The shipped configs leave them at the default unless they name a preset and say why (a test holds them).
GRAFT_FORMULA_FIELDS = ("token_is", "kappa", "peer_negative_scale", "peer_loss_scale", "is_cap", "luffy_gamma",
                        "log_rho_min", "group_normalized_weight", "union_all_success", "kl_on_peer")


class GraftOptions(_Section):
    preset: Literal["spec", "b1_no_peer_neg"] | None = Field(
        default=None,
        description="a named GRAFT: spec (the formulas as first read from the paper, docs/algorithm.md section 7: "
                    "token_is tis, peer negatives x1) or "
                    "b1_no_peer_neg (token_is none, peer_negative_scale 0); sets every field those formulas name (token_is, "
                    "is_cap, kappa, log_rho_min, peer_negative_scale, group_normalized_weight, peer_loss_scale, "
                    "union_all_success, kl_on_peer, max_grafted_fraction, luffy_gamma) and refuses another value of "
                    "them beside it. None: the fields as given")
    peer_models: list[str] | None = Field(default=None, min_length=1, description="accept peer groups only from these model ids (None: any model but the learner; an empty list would accept none and is refused)")
    union_all_success: bool = Field(default=False, description="all-fail learner + all-success peer: advantages over the union of learner failures and peer successes instead of skipping")
    kappa: float = Field(default=1.0, ge=0.0, description="exponent of the sequence compatibility weight w = min(1, rho) ** kappa")
    log_rho_min: float | None = Field(default=None, description="drop grafted samples whose per-byte log rho is below this (None: no floor)")
    token_is: Literal["tis", "none", "luffy"] = Field(default="none", description="token level: none (the default) = b = 1, the PPO-clipped ratio alone; tis (the spec preset's formula, docs/algorithm.md section 5) = truncated ratio b = pi_old/mu~ times the PPO-clipped ratio; luffy = p/(p+gamma) shaping instead of the PPO ratio, b = 1. The sequence weight w (kappa, log_rho_min, group_normalized_weight) applies under all three. Why none is the default: docs/training.md, 'Which GRAFT runs by default'")
    is_cap: float = Field(default=2.0, gt=0.0, description="C: truncation of the token behaviour ratio b = min(pi_old/mu, C)")
    luffy_gamma: float = Field(default=0.1, gt=0.0, description="gamma of the luffy shaping p/(p + gamma)")
    peer_negative_scale: float = Field(default=0.0, ge=0.0, description="multiplies negative advantages of grafted responses (0, the default: a peer's failed answers are not pushed down; 1: the spec preset's formula; docs/training.md, 'Which GRAFT runs by default')")
    group_normalized_weight: bool = Field(default=False, description="centre each grafted group's advantages under its weights, A' = A - sum(w A) / sum(w), so that tokens every row shares get no net push (with w < 1 they do otherwise); needs peer_negative_scale 1")
    peer_loss_scale: float = Field(default=1.0, gt=0.0, description="multiplies c on every grafted token (1: the spec; > 1 gives the peer's rows a larger share of the token-mean, outside the spec)")
    kl_on_peer: bool = Field(default=False, description="apply the KL term (ppo.kl_beta > 0) to grafted tokens too")
    max_grafted_fraction: float = Field(default=0.5, ge=0.0, le=1.0, description="at most this fraction of a step's groups are grafted")
    max_peer_policy_lag: int | None = Field(default=None, ge=0, description="accept peer groups with policy_step >= learner step - lag (None: any step)")
    max_peer_age_s: float | None = Field(default=None, gt=0.0, description="accept peer groups created at most this many seconds ago (None: any age)")
    peer_tokenizers: dict[str, str] | list[str] = Field(
        default_factory=dict,
        description="the peers' tokenizers, found from the tokenizer_id their stored rows carry: {tokenizer_id: local tokenizer "
                    "or model dir}, or a list of dirs whose fingerprints are their ids (the generator's default id); used to "
                    "project peer logprobs by character spans. Peers with the learner's tokenizer id need no entry; groups in "
                    "another id without an entry are refused (groups_no_peer_tokenizer)",
    )
    require_behaviour_logprobs: bool = Field(
        default=False,
        description="ask the store for peer groups whose stored logprobs are their behaviour mu only (schemas."
                    "mu_is_behaviour); off: groups without mu (text-only traces, APIs without logprobs, 'raw' logprobs "
                    "away from temperature 1, rescored_unverified ones) are grafted too, with b = 1 and w = 1 (docs/algorithm.md "
                    "section 11), and counted (peer_rollouts_mu_set_aside: stored logprobs that were not used as mu)")
    trust_unverified_mu: bool = Field(
        default=False,
        description="use as mu the logprobs of rows rescored by weights not shown to be the ones that sampled them "
                    "(logprobs_mode rescored_unverified: another model's probabilities); off: they graft as rows without "
                    "mu (b = 1, w = 1) and are counted in peer_rollouts_mu_set_aside")
    uniform_projection: bool = Field(
        default=False,
        description="opt-in: graft peer groups whose tokenizer is not in peer_tokenizers, spreading their logprob_sum evenly "
                    "over the text's characters (mu~ per token, so b, then carries little); off: such groups are refused",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        preset = data.get("preset") if isinstance(data, dict) else None
        if preset not in GRAFT_PRESETS:
            return data  # no preset, or a name the field's own validation refuses
        named = GRAFT_PRESETS[preset]
        clash = {name: data[name] for name in named if name in data and data[name] != named[name]}
        if clash:
            raise ValueError(f"graft.preset = {preset} sets {named}, but the config also gives {clash}: drop the preset "
                             "to set these fields one by one, or drop the fields")
        return {**data, **named}

    @model_validator(mode="after")
    def _consistent(self) -> GraftOptions:
        if self.group_normalized_weight and self.peer_negative_scale != 1.0:
            raise ValueError(
                f"graft.group_normalized_weight with graft.peer_negative_scale = {self.peer_negative_scale}: the first centres "
                "each grafted group's advantages so that sum(w A) = 0, the second rescales its negative ones afterwards and "
                "undoes that; use one of the two")
        if self.trust_unverified_mu and self.require_behaviour_logprobs:
            raise ValueError(
                "graft.trust_unverified_mu with graft.require_behaviour_logprobs: the store serves under the second only "
                "groups whose rows show their logprobs to be mu, which rescored_unverified ones do not, so the first "
                "would change nothing; drop one of the two")
        return self

    def departures(self) -> dict[str, tuple[Any, Any]]:
        """{field: (value, the trainers' default)} for each GRAFT_FORMULA_FIELDS field this section does not leave at
        its default: empty for the trainers' default GRAFT."""
        default = GraftOptions()
        return {name: (getattr(self, name), getattr(default, name)) for name in GRAFT_FORMULA_FIELDS
                if getattr(self, name) != getattr(default, name)}

    def describe(self) -> str:
        """One line: which GRAFT this section trains with (`graft-train show-config` prints it)."""
        departures = self.departures()
        if not departures:
            named = ", ".join(f"{name} {getattr(self, name)}" for name in GRAFT_PRESETS["spec"])
            return f"the trainers' default GRAFT ({named}: docs/training.md, 'Which GRAFT runs by default')"
        changed = ", ".join(f"{name} {value} (default {default})" for name, (value, default) in departures.items())
        if departures == GraftOptions(preset="spec").departures():
            return f"the `spec` preset's formulas as written (graft.preset spec), not the trainers' default: {changed}"
        return f"not the trainers' default GRAFT: {changed}"


class DapoConfig(_Section):
    max_generation_rounds: int = Field(default=3, ge=1, description="dynamic sampling: generation rounds per step (the first plus refills) before training on what was kept")


class StoreConfig(_Section):
    """The store this run talks to, and how it asks (how peer groups arrive is `peers`, a section of its own)."""

    url: str | None = Field(default=None, description="store base URL, e.g. http://127.0.0.1:8600 (required for method=graft)")
    token: str | None = Field(default=None, description="bearer token for pushing groups, when the store requires one")
    timeout_s: float = Field(default=10.0, gt=0.0, description="HTTP timeout of one store call")
    retries: int = Field(default=1, ge=0, description="client retries per call (the trainer backs off across steps on its own)")
    backoff_initial_s: float = Field(default=1.0, gt=0.0, description="first pause after a failed store call; doubles per failure")
    backoff_max_s: float = Field(default=30.0, gt=0.0, description="longest pause between store attempts")
    groups_per_prompt: int = Field(default=4, ge=1, le=16, description="peer groups asked per prompt, in the serving order (store.serve_order)")
    want_misses: bool = Field(default=False, description="post each step's all-fail prompts that got no peer group to graft to the store's wanted prompts (POST /v1/wanted), with their problems and this learner's rule of which groups it takes: generators with follow_wanted sample them first, a group the rule takes clears them, and later lookups find it")
    max_times_served: int | None = Field(default=None, ge=1, description="serving policy: the store serves a group to this learner at most this many times (its served ledger, which the trainer then fills with what it grafts); None: no cap")
    serve_order: ServeOrder = Field(default="freshest", description="serving policy: which accepted groups the lookup gives first, and the gate takes first: freshest (highest policy step, then newest), most_successes, or least_served (fewest grafts by this learner; the trainer then fills the ledger)")

    @model_validator(mode="before")
    @classmethod
    def _no_source_fields(cls, data: Any) -> Any:
        """The store section's keys of earlier releases that said how peers arrive: refused here, naming the new setting
        (a whole TrainConfig maps them first: `TrainConfig._peers_from_old_store_keys`)."""
        if isinstance(data, dict):
            old = [key for key in OLD_SOURCE_KEYS if key in data]
            if old:
                raise ValueError(f"store.{', store.'.join(old)}: how peer groups arrive is one setting now, peers.source "
                                 "(prefetch | cotrain | lockstep | replay), with each source's own settings beside it")
        return data

    @property
    def records_served(self) -> bool:
        """Whether the trainer posts what it grafts to the store's served ledger: when the serving policy reads it."""
        return self.max_times_served is not None or self.serve_order == "least_served"


# ---- how peer groups arrive: one setting, peers.source, and each source's own settings beside it -------------------

class _PeerSourceSection(KindSection):
    SECTION, KIND = "peers", "source"  # a setting of another source is refused, naming what this source takes


# After generation, how long a step waits at most for the peer lookup that ran while it sampled, in every trainer
# (graft-train's peers.lookup_wait_s, TRL's graft_lookup_wait_s, verl's graft.lookup_wait_s): the lookup is back long
# before a step's sampling ends unless the store is slow, so the wait costs nothing then, and a step's grafts do not
# depend on the store's speed; a slow store costs each step at most this (counted; said after a few steps in a row)
LOOKUP_WAIT_S = 30.0


class PrefetchPeers(_PeerSourceSection):
    """Offline: the step's lookup runs in the background while the learner samples; the gate takes what is back."""

    source: Literal["prefetch"] = Field(default="prefetch", description="prefetch: read the store; the step's lookup runs while the learner samples, and the gate takes what is back")
    lookup_wait_s: float = Field(default=LOOKUP_WAIT_S, ge=0.0, description="prefetch: after generation, wait at most this long for the step's peer lookup (it ran while the step sampled); 0: graft only what is already back. A step's wait is store_wait_s; a step whose lookup was still out trains as GRPO, counted in store_lookups_late, and a few such steps in a row are warned about")
    publish: bool = Field(default=False, description="prefetch: also push every sampled group to the store, in the background (others' peers; co-training sources always do)")


class CotrainPeers(_PeerSourceSection):
    """Co-training: publish every sampled group, and wait a bounded time for the co-trainer's groups."""

    source: Literal["cotrain"] = Field(description="cotrain: publish every sampled group; the step waits up to wait_s for the co-trainer's groups of its all-fail prompts")
    wait_s: float = Field(default=30.0, ge=0.0, description="cotrain: the longest wait per step for peer groups of this step's all-fail prompts")
    poll_s: float = Field(default=0.25, gt=0.0, description="cotrain: pause between lookups while waiting")


class LockstepPeers(_PeerSourceSection):
    """Lockstep co-training: every step takes exactly the partners' groups of that very step, as long as they live."""

    source: Literal["lockstep"] = Field(description="lockstep: publish every sampled group; every step waits for each partner's (graft.peer_models) group of that very step for each of its prompts and grafts only those: the same command gives the same metrics. Both trainers draw the same prompts (same seed, data, rollout.prompts_per_step)")
    partner_timeout_s: float = Field(default=300.0, gt=0.0, description="lockstep: a partner that shows no sign of life for this long (no heartbeat in the store, no new group; or one waiting for this trainer as it waits for the partner) is gone: the run stops naming it. A partner busy with an evaluation or a checkpoint keeps beating and is waited for, however long")
    poll_s: float = Field(default=0.25, gt=0.0, description="lockstep: pause between lookups while waiting")

    @property
    def heartbeat_s(self) -> float:
        """How often this trainer tells the store it lives: several beats within a partner's timeout."""
        return min(10.0, max(0.2, self.partner_timeout_s / 6))


class ReplayPeers(_PeerSourceSection):
    """A rerun of a recorded run: its peer groups by id, checked against what the run recorded."""

    source: Literal["replay"] = Field(description="replay: rerun the run in run_dir from its peer_groups.jsonl: each step's peer groups are fetched from the store by id and checked against their recorded sha256 (no lookup, no wait, nothing published), and the learner's own rewards and the grafted ids are compared with the run's, stopping at the first difference; the config must equal that run's but for run_dir, peers, store.url/token and logging (graft-train replay)")
    run_dir: Path = Field(description="replay: the recorded run's directory (its config.yaml and peer_groups.jsonl)")


PeersConfig = Annotated[PrefetchPeers | CotrainPeers | LockstepPeers | ReplayPeers, Field(discriminator="source")]
SOURCE_SECTIONS = {"prefetch": PrefetchPeers, "cotrain": CotrainPeers, "lockstep": LockstepPeers, "replay": ReplayPeers}


def host_peers(source: str, lookup_wait_s: float | None, publish: bool | None, options: dict[str, Any] | None,
               runs: tuple[str, ...], why_not: dict[str, str], names: dict[str, str]) -> dict[str, Any]:
    """The peers section of a framework's run (TRL's, verl's) from its settings: the source, prefetch's wait (None: its
    default), whether prefetch publishes (None: the source's own way) and the source's other settings (`options`:
    cotrain's wait_s, ...). `runs`: the sources the framework's trainer runs; another is refused, with `why_not` its
    reason, and so is a setting that would do nothing with the source. `names`: the framework's name of each of the four
    settings (source, lookup_wait_s, publish, options)."""
    if source not in runs:
        raise ValueError(f"{names['source']} {source!r}: this trainer runs {', '.join(runs)}"
                         + (f"; {source}: {why_not[source]}" if source in why_not else ""))
    options = dict(options or {})
    own = [key for key in ("source", "lookup_wait_s", "publish") if key in options]
    if own:
        raise ValueError(f"{names['options']}: give {', '.join(own)} as {', '.join(names[key] for key in own)}")
    if lookup_wait_s is not None and source != "prefetch":
        raise ValueError(f"{names['lookup_wait_s']} with {names['source']} {source}: it is prefetch's wait (a co-training "
                         f"source waits as {names['options']} says: cotrain wait_s, lockstep partner_timeout_s)")
    if publish is False and source in ("cotrain", "lockstep"):
        raise ValueError(f"{names['publish']} false with {names['source']} {source}: a co-trainer publishes its groups "
                         "(its partner waits for them); read the store without publishing with prefetch")
    peers = {"source": source, **options}
    if source == "prefetch":
        peers |= {key: value for key, value in (("lookup_wait_s", lookup_wait_s), ("publish", publish)) if value is not None}
    try:
        SOURCE_SECTIONS[source].model_validate(peers)
    except ValueError as error:
        raise ValueError(f"{names['options']}: {error}") from None
    return peers
PEER_SOURCES = ("prefetch", "cotrain", "lockstep", "replay")
# store.* keys of earlier releases that said how peers arrive, now peers.* (TrainConfig._peers_from_old_store_keys)
OLD_SOURCE_KEYS = ("mode", "publish", "lookup_wait_s", "cotrain_wait_s", "cotrain_poll_s", "cotrain_lockstep", "replay_from")


def peers_from_old_store_keys(store: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The peers section that store.mode, store.cotrain_lockstep, store.replay_from, store.publish and the waits of
    earlier releases meant, popped from `store`, and what was mapped (said out loud by the caller). ValueError for a
    combination that has no meaning now (co-training without publishing, a lookup wait in co-training)."""
    old = {key: store.pop(key) for key in OLD_SOURCE_KEYS if key in store}
    mode, lockstep = old.get("mode", "offline"), bool(old.get("cotrain_lockstep"))
    if old.get("replay_from") is not None:
        peers: dict[str, Any] = {"source": "replay", "run_dir": old["replay_from"]}
    elif mode == "cotrain":
        if old.get("publish") is False:
            raise ValueError("store.mode cotrain with store.publish false: a co-trainer publishes its groups (its partner "
                             "waits for them); use peers.source prefetch to read the store without publishing")
        if old.get("lookup_wait_s"):
            raise ValueError(f"store.lookup_wait_s = {old['lookup_wait_s']} with store.mode 'cotrain': co-training waits "
                             "for the co-trainer's groups up to peers.wait_s (lookup_wait_s is prefetch's wait)")
        peers = {"source": "lockstep" if lockstep else "cotrain"}
        if "cotrain_wait_s" in old:
            peers["partner_timeout_s" if lockstep else "wait_s"] = old["cotrain_wait_s"]
        if "cotrain_poll_s" in old:
            peers["poll_s"] = old["cotrain_poll_s"]
    else:  # offline: the cotrain_* keys applied in co-training only, and did nothing here
        peers = {"source": "prefetch", **{key: old[key] for key in ("lookup_wait_s", "publish") if old.get(key) is not None}}
    mapped = [f"store.{key}: {value}" for key, value in old.items()]
    return peers, mapped


class AnchorConfig(_Section):
    dataset: str | None = Field(default=None, description="JSONL of problems with reference completions (fields problem, completion); None: no anchor")
    prompts_per_step: int = Field(default=4, ge=1, description="reference completions per step in the anchor term")
    weight: float = Field(default=1.0, ge=0.0, description="weight of the anchor's token-mean NLL added to the loss")
    step_rows: str | None = Field(
        default=None,
        description="JSONL of rows (fields step, problem, completion) supervised at that step (0-based) beside the "
                    "update, their summed NLL over the step's token-mean denominator: each weighs what a grafted row "
                    "of weight 1 and advantage 1 would. With one update per step only. A control, not a method: the "
                    "mutual study (issue 60) gives GRPO the rows a GRAFT run grafted, to tell GRAFT's loss form from "
                    "its rows. None: none")


class PeriodicEvalConfig(_Section):
    every_steps: int = Field(default=0, ge=0, description="evaluate every N steps and at the end (0: never)")
    benchmarks: dict[str, str] = Field(default_factory=dict, description="benchmark name -> JSONL path or data set name")
    limit: int | None = Field(default=None, ge=1, description="first N problems of each benchmark")
    k: int = Field(default=1, ge=1, description="samples per problem (avg@k); greedy when 1")
    temperature: float = Field(default=0.6, gt=0.0, description="sampling temperature for k > 1")
    top_p: float = Field(default=0.95, gt=0.0, le=1.0, description="nucleus mass for k > 1")
    max_tokens: int | None = Field(default=None, ge=1, description="completion budget (None: rollout.max_response_tokens)")


class CheckpointConfig(_Section):
    every_steps: int = Field(default=0, ge=0, description="save a checkpoint every N steps and at the end (0: only at the end)")
    keep_last: int | None = Field(default=2, ge=1, description="keep only the newest N checkpoints (None: keep all)")
    optimizer_in_newest_only: bool = Field(default=False, description="drop the optimizer state (twice the weights' size) from every checkpoint but the newest: the older ones keep their weights and can no longer be resumed (one-process runs; dcp/ checkpoints are kept whole)")


class LoggingConfig(_Section):
    tensorboard: bool = Field(default=False, description="also write TensorBoard scalars to <run_dir>/tb")
    progress: bool = Field(default=True, description="show a progress bar")


class ParallelConfig(_Section):
    strategy: Literal["none", "ddp", "fsdp"] = Field(
        default="none",
        description="data parallelism over the ranks torchrun starts: none (one process); ddp (full replicas, gradients "
                    "all-reduced); fsdp (FSDP2 fully_shard per decoder layer and on the whole model)",
    )
    timeout_s: float = Field(default=1800.0, gt=0.0, description="a collective waiting longer than this fails the run instead of hanging it")


class TrainConfig(_Section):
    run_dir: Path = Field(default=Path("runs/train"), description="where metrics, checkpoints and the resolved config go")
    seed: int = Field(default=0, description="seeds prompt order, sampling and initialisation of everything random")
    steps: int = Field(default=100, ge=1, description="training steps")
    torch_threads: int | None = Field(default=None, ge=1, description="CPU threads torch may use (None: torch's default; 1 is fastest for tiny models on a busy machine)")
    method: Literal["grpo", "graft", "dapo"] = Field(default="graft", description="grpo: gate off; graft: peer groups replace all-fail groups; dapo: dynamic sampling baseline")
    model: ModelConfig
    data: DataConfig
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="the learner's prompt (its rollouts', grafted rows', the anchor's and the evaluations'); give its peers' generators the same")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    graft: GraftOptions = Field(default_factory=GraftOptions)
    dapo: DapoConfig = Field(default_factory=DapoConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    peers: PeersConfig = Field(default_factory=PrefetchPeers, description="how peer groups arrive: peers.source prefetch (the default), cotrain, lockstep or replay, with that source's settings beside it")
    anchor: AnchorConfig = Field(default_factory=AnchorConfig)
    eval: PeriodicEvalConfig = Field(default_factory=PeriodicEvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @model_validator(mode="before")
    @classmethod
    def _peers_from_old_store_keys(cls, data: Any) -> Any:
        """store.mode, store.cotrain_lockstep, store.replay_from, store.publish and the waits of earlier releases mapped
        to the peers section they meant, said out loud; a peers section without a source is prefetch's."""
        if not isinstance(data, dict):
            return data
        store = data.get("store")
        if isinstance(store, dict) and any(key in store for key in OLD_SOURCE_KEYS):
            if "peers" in data:
                raise ValueError(f"store.{', store.'.join(k for k in OLD_SOURCE_KEYS if k in store)} beside a peers "
                                 "section: how peer groups arrive is peers.source now; drop the store keys")
            store = dict(store)
            peers, mapped = peers_from_old_store_keys(store)
            data = {**data, "store": store, "peers": peers}
            warnings.warn(f"{'; '.join(mapped)}: these keys are gone, read as peers: {peers} (write that instead: "
                          "graft-train show-config lists the peers.* settings)", FutureWarning, stacklevel=2)
        peers = data.get("peers")
        if isinstance(peers, dict) and "source" not in peers:
            data = {**data, "peers": {"source": "prefetch", **peers}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        source = self.peers.source
        if self.method == "graft" and not self.store.url:
            raise ValueError("method 'graft' needs store.url (the store to take peer groups from); set it, or use method 'grpo'")
        if self.publishes and not self.store.url:
            raise ValueError(f"peers.source {source} publishes this run's groups: it needs store.url")
        if source != "prefetch" and self.method != "graft":
            raise ValueError(f"peers.source {source} with method {self.method!r}: only GRAFT takes peer groups; a run that "
                             "only gives its groups to others is peers.source prefetch with peers.publish true")
        broker = [f"store.{name}" for name, on in (("want_misses", self.store.want_misses),
                  ("max_times_served", self.store.max_times_served is not None),
                  ("serve_order", self.store.serve_order != "freshest")) if on]
        if broker and self.method != "graft":
            raise ValueError(f"{', '.join(broker)} with method {self.method!r}: only GRAFT looks peer groups up, so it would "
                             "do nothing; drop it, or use method 'graft'")
        # (a replay keeps its run's settings, as recorded, and neither looks up nor posts: graft.trainer.replay)
        if broker and source == "lockstep":
            raise ValueError(f"{', '.join(broker)} with peers.source lockstep: a lockstep step grafts the partner's "
                             "groups of that very step whatever the serving policy, and the partner samples every "
                             "prompt anyway, so it would do nothing or stall the step; drop it")
        if source in ("lockstep", "replay"):
            self._check_reproducible_peers()
        if self.parallel.strategy != "none" and self.rollout.seed_per_sample is False:
            raise ValueError(
                f"rollout.seed_per_sample false with parallel.strategy {self.parallel.strategy!r}: each rank would seed its "
                "generate call alike, and N ranks would not draw what one process draws; leave it unset (or true)"
            )
        if self.parallel.strategy != "none" and self.model.device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"model.device {self.model.device!r} with parallel.strategy {self.parallel.strategy!r}: each rank takes the "
                "GPU of its LOCAL_RANK; set model.device to auto, cuda or cpu"
            )
        if self.rollout.hf_sampler_copy and (self.model.dtype == "float32" or self.rollout.backend == "vllm"
                                             or self.parallel.strategy == "fsdp"):
            raise ValueError(
                "rollout.hf_sampler_copy samples the hf backend from a bfloat16 copy of the policy: it needs "
                "model.dtype bfloat16, rollout.backend hf (or auto on a CPU) and parallel.strategy none or ddp; "
                f"here model.dtype={self.model.dtype}, rollout.backend={self.rollout.backend}, "
                f"parallel.strategy={self.parallel.strategy}: drop it")
        if self.anchor.step_rows is not None and (self.optim.ppo_epochs != 1
                                                  or self.optim.mini_batch_prompts != self.rollout.prompts_per_step
                                                  or self.ppo.loss_agg != "token-mean"):
            raise ValueError("anchor.step_rows weighs its rows over the step's token-mean denominator: it needs one "
                             "optimizer update per step (optim.ppo_epochs 1, optim.mini_batch_prompts = "
                             "rollout.prompts_per_step) and ppo.loss_agg token-mean")
        if self.optim.mini_batch_prompts > self.rollout.prompts_per_step:
            raise ValueError(
                f"optim.mini_batch_prompts = {self.optim.mini_batch_prompts} exceeds rollout.prompts_per_step = "
                f"{self.rollout.prompts_per_step}; a mini-batch cannot be larger than the step's batch: change "
                f"them together, e.g. --set optim.mini_batch_prompts={self.rollout.prompts_per_step} (one update per epoch)"
            )
        return self

    def _check_reproducible_peers(self) -> None:
        """peers.source lockstep and replay promise a step's peer groups that do not depend on timing."""
        what = f"peers.source {self.peers.source}"
        if self.peers.source == "lockstep" and not self.graft.peer_models:
            raise ValueError("peers.source lockstep waits for named partners: it needs graft.peer_models (the "
                             "co-trainers' model ids, e.g. --peer-models peer)")
        if self.graft.max_peer_age_s is not None:
            raise ValueError(f"graft.max_peer_age_s = {self.graft.max_peer_age_s} is a wall-clock bound: with {what} "
                             "the groups a step admits would depend on timing; bound the lag in steps instead "
                             "(graft.max_peer_policy_lag)")
        if self.parallel.strategy != "none":
            raise ValueError(f"{what} is not supported under parallel.strategy {self.parallel.strategy!r} yet: run one "
                             "process")

    def grafting(self) -> str:
        """One line: which GRAFT the run trains with (show-config and --dry-run print it)."""
        if self.method != "graft":
            return f"method {self.method}: no grafting, the graft section is unused"
        return f"GRAFT: {self.graft.describe()}"

    @property
    def publishes(self) -> bool:
        """Whether sampled groups are pushed to the store: co-training always, prefetch when peers.publish says so, a
        replay never (its groups are the recorded run's)."""
        return self.peers.source in ("cotrain", "lockstep") or (self.peers.source == "prefetch" and self.peers.publish)

    @property
    def co_trains(self) -> bool:
        """Whether a co-trainer's groups are waited for (cotrain, lockstep)."""
        return self.peers.source in ("cotrain", "lockstep")


def missing_inputs(cfg: TrainConfig) -> list[str]:
    """Each input the config names that is not there (or, the training data, cannot be read), as `field: path (what
    was looked for)`: a run would fail on it only after loading the model, and a dry run that passed would have said
    nothing."""
    from graft.rollouts.datasets import load_problems, resolve_dataset

    missing = []
    if not Path(cfg.model.path).expanduser().exists():
        missing.append(f"model.path: {cfg.model.path} does not exist (an HF model directory or a .gguf file)")
    try:  # read whole, with its columns: a file the run could not read fails here, in one line, not after the model loads
        if not load_problems(cfg.data.dataset, limit=cfg.data.limit, problem_field=cfg.data.problem_field,
                             answer_field=cfg.data.answer_field):
            missing.append(f"data.dataset: {cfg.data.dataset} holds no problems")
    except (FileNotFoundError, ValueError) as error:
        missing.append(f"data.dataset: {error}")
    datasets = {f"eval.benchmarks.{k}": v for k, v in cfg.eval.benchmarks.items()}
    for field, name in datasets.items():
        try:
            resolve_dataset(name)
        except FileNotFoundError as error:
            missing.append(f"{field}: {error}")
    if cfg.anchor.dataset is not None and not Path(cfg.anchor.dataset).is_file():
        missing.append(f"anchor.dataset: {cfg.anchor.dataset} does not exist (a JSONL of problem + completion)")
    if cfg.anchor.step_rows is not None and not Path(cfg.anchor.step_rows).is_file():
        missing.append(f"anchor.step_rows: {cfg.anchor.step_rows} does not exist (a JSONL of step + problem + completion)")
    tokenizers = cfg.graft.peer_tokenizers
    for where, path in (tokenizers.items() if isinstance(tokenizers, dict) else enumerate(tokenizers)):
        if not Path(path).expanduser().exists():
            missing.append(f"graft.peer_tokenizers[{where}]: {path} does not exist")
    return missing
