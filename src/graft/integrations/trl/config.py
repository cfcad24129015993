"""`GraftConfig`: TRL's GRPOConfig plus the store to graft from (and publish to) and graft-train's GRAFT options.

The GRAFT options are graft-train's own sections (`graft.trainer.config.GraftOptions`, `StoreConfig` and the peers
section: how peer groups arrive, whether the run publishes), validated by them: the same defaults, the same errors.
What TRL cannot do the way graft-train does is refused here, saying why; everything else about the loss stays TRL's (the
per-token weight c = w * b rides in the advantages, and every TRL loss is linear in them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from trl import GRPOConfig

from graft.trainer import GraftOptions, StoreConfig, TrainConfig, host_peers

# TRL's loss aggregations and graft-train's names for the same rule (the loss equality tests compare them)
LOSS_AGG = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
TRL_SOURCES = ("prefetch", "cotrain", "lockstep")  # the peer sources (graft-train's peers.source) the adapter runs
TRL_WHY_NOT = {"replay": "it reruns a graft-train run from the record that run wrote (graft-train replay)"}
TRL_NAMES = {"source": "graft_peer_source", "lookup_wait_s": "graft_lookup_wait_s", "publish": "graft_publish",
             "options": "graft_peer_options"}


@dataclass
class GraftConfig(GRPOConfig):
    """GRPOConfig with GRAFT: set `graft_store_url` (and usually `graft_peer_tokenizers`); None is plain GRPO."""

    # graft-train's clip where the user sets none (docs/algorithm.md section 5: eps_high 0.28, dual clip c = 3 on negative advantages):
    # TRL's defaults (epsilon_high None = epsilon, delta None = no dual clip) would run GRAFT, and the GRPO arm it is
    # compared with, under another loss than graft-train's. TRL's delta clamps the ratio at delta on every token, which
    # for a positive advantage changes nothing (the clipped term is already the smaller) and for a negative one is the
    # dual clip. Set epsilon_high=None, delta=None for TRL's own.
    epsilon_high: float | None = field(
        default=0.28, metadata={"help": "upper clip of the ratio, 1 + epsilon_high (graft-train's 0.28, DAPO's clip-higher; "
                                        "None: epsilon, TRL's default)"})
    delta: float | None = field(
        default=3.0, metadata={"help": "ratio clamp of two-sided GRPO, which is graft-train's dual clip c on negative "
                                       "advantages (graft-train's 3.0; None: off, TRL's default)"})
    graft_store_url: str | None = field(
        default=None, metadata={"help": "store base URL to take peer groups from, e.g. http://127.0.0.1:8600 (None: plain GRPO)"})
    graft_model_id: str | None = field(
        default=None, metadata={"help": "the learner's model id in the store (its own groups are never grafted); "
                                        "default: the model's directory or hub name, as graft-train names it"})
    graft_tokenizer_id: str | None = field(
        default=None, metadata={"help": "the learner's tokenizer id; peers with the same id take the exact path; "
                                        "default: its fingerprint (as the generator stores it)"})
    graft_peer_tokenizers: list[str] | None = field(
        default=None, metadata={"help": "the peers' tokenizers: model or tokenizer directories (their fingerprints are "
                                        "their ids), or ID=DIR for a peer that stored another id"})
    graft_prompt_id_column: str = field(
        default="prompt_id", metadata={"help": "dataset column holding each prompt's store id (schemas.prompt_id of "
                                               "the problem text, as the generator stored it)"})
    graft_peer_source: str = field(
        default="prefetch", metadata={"help": "how peer groups arrive (graft-train's peers.source): prefetch (the lookup "
                                              "runs while TRL generates), cotrain or lockstep (co-training: the run "
                                              "publishes its groups and waits for its co-trainer's); replay is refused"})
    graft_lookup_wait_s: float | None = field(
        default=None, metadata={"help": "prefetch: after generation, wait at most this long for the peer lookup (it runs "
                                        "while TRL generates); 0: graft only what is already back; None: graft-train's "
                                        "peers.lookup_wait_s (30 s)"})
    graft_publish: bool | None = field(
        default=None, metadata={"help": "push this run's own groups to the store, in the background: the sampled token "
                                        "ids, their behaviour logprobs (the mode TRL's sampler ran: say GraftGRPOTrainer's "
                                        "log), the run's rewards, model id, revision and step (None: the source's way: "
                                        "prefetch does not, cotrain and lockstep always do)"})
    graft_peer_options: dict | str | None = field(
        default=None, metadata={"help": "the source's other settings, graft-train's peers.* (JSON from the command line): "
                                        "cotrain's wait_s, poll_s; lockstep's partner_timeout_s, poll_s"})
    graft_problem_column: str = field(
        default="problem", metadata={"help": "dataset column holding each prompt's problem text (prompt_id(text) is its "
                                             "store id), with graft_answer_column its gold answer: sent with the run's "
                                             "wants (graft_store_options want_misses needs them) and pushed with its "
                                             "groups, where the dataset has them"})
    graft_answer_column: str = field(
        default="answer", metadata={"help": "dataset column holding each prompt's gold answer (see graft_problem_column)"})
    graft_options: dict | str | None = field(
        default=None, metadata={"help": "graft-train's graft section (JSON from the command line): kappa, is_cap, "
                                        "token_is, max_grafted_fraction, peer_models, ... (graft-train show-config)"})
    graft_store_options: dict | str | None = field(
        default=None, metadata={"help": "graft-train's store section but url: token, timeout_s, retries, backoff_*, "
                                        "groups_per_prompt, and the broker's want_misses, max_times_served, serve_order"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("graft_options", "graft_store_options", "graft_peer_options"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, json.loads(value))
        if self.graft_lookup_wait_s is not None and self.graft_lookup_wait_s < 0:
            raise ValueError(f"graft_lookup_wait_s = {self.graft_lookup_wait_s}: a wait cannot be negative")
        if self.graft_publish and not self.grafts:
            raise ValueError("graft_publish without graft_store_url: there is no store to publish to")
        graft = self.graft_section()  # validates; the checks below are what TRL's loop cannot do as graft-train does
        self.store_section()
        self.peers_section()
        if self.grafts:  # graft-train's rules across its sections (lockstep and the broker's settings, ...)
            self.train_config("model")
        if graft.union_all_success:
            raise ValueError("graft_options.union_all_success: a union group has more rows than the G slots TRL's "
                             "batch holds for the prompt; leave it off under TRL")
        if graft.token_is == "luffy":
            raise ValueError("graft_options.token_is 'luffy' replaces the PPO ratio inside the loss, which TRL computes; "
                             "use 'tis' (the default) or 'none'")
        if self.beta != 0.0 and not graft.kl_on_peer:
            raise ValueError(f"beta = {self.beta}: TRL's KL term covers every token, grafted ones too; set "
                             "graft_options.kl_on_peer true to accept that, or beta 0")
        if self.scale_rewards == "batch" or self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError("GRAFT computes a peer group's advantages within the group, as TRL's scale_rewards 'group' "
                             "(or 'none', Dr. GRPO) does with multi_objective_aggregation 'sum_then_normalize'; "
                             f"scale_rewards {self.scale_rewards!r} with {self.multi_objective_aggregation!r} would mix "
                             "two conventions in one batch")

    @property
    def grafts(self) -> bool:
        """Whether the trainer grafts (a store is configured)."""
        return self.graft_store_url is not None

    def graft_section(self) -> GraftOptions:
        """graft-train's graft section: graft_options and graft_peer_tokenizers (validated)."""
        entries = list(self.graft_peer_tokenizers or [])
        pairs = [entry.split("=", 1) for entry in entries if "=" in entry]
        if pairs and len(pairs) != len(entries):
            raise ValueError(f"graft_peer_tokenizers {entries}: give every entry as ID=DIR or none (DIR alone)")
        peer_tokenizers: dict[str, str] | list[str] = dict(pairs) if pairs else entries
        return GraftOptions.model_validate({**(self.graft_options or {}), "peer_tokenizers": peer_tokenizers})

    def store_section(self) -> StoreConfig:
        """graft-train's store section (how peers arrive is graft_peer_source, never a store option)."""
        options = dict(self.graft_store_options or {})
        if "url" in options:
            raise ValueError("graft_store_options: the URL is graft_store_url")
        try:
            return StoreConfig.model_validate({**options, "url": self.graft_store_url})
        except ValueError as error:
            raise ValueError(f"graft_store_options: {error} (the TRL adapter's source is graft_peer_source, its wait "
                             "graft_lookup_wait_s, whether it publishes graft_publish)") from None

    def peers_section(self) -> dict:
        """graft-train's peers section: graft_peer_source, graft_lookup_wait_s, graft_publish, graft_peer_options."""
        return host_peers(self.graft_peer_source, self.graft_lookup_wait_s, self.graft_publish, self.graft_peer_options,
                          TRL_SOURCES, TRL_WHY_NOT, TRL_NAMES)

    def train_config(self, model_path: str, dataset: str = "trl-dataset") -> TrainConfig:
        """graft-train's configuration of the same run: what the shared functions (weights, peer tokenizers, the
        store client) read, and what the loss equality tests and the side-by-side benchmark run graft-train with.

        ppo takes TRL's clip (epsilon, epsilon_high, delta as the dual clip) and, for TRL's dapo, bnpo, grpo and
        dr_grpo losses, graft-train's name of their aggregation; TRL's other losses keep graft-train's default (c
        folds into them all the same). dataset names the problems' JSONL for graft-train (TRL feeds its own)."""
        prompts_per_step = self.generation_batch_size // self.num_generations
        return TrainConfig.model_validate({
            "seed": self.seed, "steps": max(self.max_steps, 1), "method": "graft" if self.grafts else "grpo",
            "model": {"path": model_path, "model_id": self.graft_model_id, "tokenizer_id": self.graft_tokenizer_id},
            "data": {"dataset": dataset},
            "rollout": {"group_size": self.num_generations, "prompts_per_step": prompts_per_step,
                        "temperature": self.temperature, "top_p": self.top_p,
                        "top_k": self.top_k if self.top_k and self.top_k > 0 else None,
                        "max_response_tokens": self.max_completion_length},
            "optim": {"lr": self.learning_rate, "weight_decay": self.weight_decay, "grad_clip": self.max_grad_norm or None,
                      "ppo_epochs": self.num_iterations, "micro_batch_size": self.per_device_train_batch_size,
                      "mini_batch_prompts": max(1, prompts_per_step // self.steps_per_generation)},
            "ppo": {"eps_low": self.epsilon, "eps_high": self.epsilon_high if self.epsilon_high is not None else self.epsilon,
                    "dual_clip_c": self.delta, "kl_beta": self.beta,
                    "advantage": "dr_grpo" if self.scale_rewards == "none" else "grpo",
                    **({"loss_agg": LOSS_AGG[self.loss_type]} if self.loss_type in LOSS_AGG else {})},
            "graft": self.graft_section().model_dump(),
            "store": self.store_section().model_dump() if self.grafts else {},
            "peers": self.peers_section(),
        })

