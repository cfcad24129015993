"""The `graft` section a verl run adds to its config, graft-train's configuration of the same run, and the verl settings
GRAFT refuses (each with the reason), checked before verl starts a worker.

A verl user adds, with Hydra's `+` (verl's schema has no `graft` section):

    trainer.v1.trainer_mode=graft_sync
    +graft.store_url=http://127.0.0.1:8600
    +graft.peer_tokenizers=[/models/peer]
    +graft.options.kappa=0.5            # any field of graft-train's graft section (graft-train show-config)
    +graft.publish=true                 # the run's own groups to the store too: a peer of other runs

The GRAFT options are graft-train's own sections (`graft.trainer.config.GraftOptions`, `StoreConfig` and the peers
section: how peer groups arrive, whether the run publishes), validated by them: the same defaults, the same errors.
What verl cannot do the way graft-train does is refused here, saying why.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field

from graft.trainer import GraftOptions, StoreConfig, TrainConfig, host_peers

TRAINER_MODE = "graft_sync"
# verl's loss aggregations that graft-train's loss has (the parity test compares them); verl's others it has not
LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SINGLE_TURN_AGENT = "single_turn_agent"  # verl's default agent loop: its rollouts are scored by the reward loop
VERL_SOURCES = ("prefetch", "cotrain")  # the peer sources (graft-train's peers.source) the verl trainer runs
VERL_WHY_NOT = {
    "lockstep": "a lockstep step waits for its partner's group of each of its prompts at that very step, and verl's sync "
                "trainer does not train a fixed set of prompts per step (a prompt whose sessions all failed leaves its "
                "batch, and its replay buffer refills from later prompts), so two runs would wait for groups the other "
                "never samples; co-train with cotrain",
    "replay": "it reruns a graft-train run from the record that run wrote (graft-train replay)",
}
VERL_NAMES = {"source": "graft.peer_source", "lookup_wait_s": "graft.lookup_wait_s", "publish": "graft.publish",
              "options": "graft.peer_options"}


class VerlGraftSection(BaseModel):
    """`graft` in a verl config. Without store_url the trainer is verl's sync trainer, unchanged."""

    model_config = ConfigDict(extra="forbid")  # a typo under graft. fails loudly

    store_url: str | None = Field(default=None, description="store base URL to take peer groups from (None: plain verl)")
    model_id: str | None = Field(default=None, description="the learner's model id in the store (its own groups are "
                                 "never grafted); default: the model's directory or hub name, as graft-train names it")
    tokenizer_id: str | None = Field(default=None, description="the learner's tokenizer id; default: its fingerprint")
    peer_tokenizers: list[str] | dict[str, str] = Field(
        default_factory=list, description="the peers' tokenizers: directories (their fingerprints are their ids); a "
        "peer that stored another id: ID -> DIR (+graft.peer_tokenizers.ID=DIR, one override per peer), or 'ID=DIR'")
    prompt_id_key: str = Field(default="prompt_id", description="key of each dataset row's extra_info holding its store "
                               "prompt id (schemas.prompt_id of the problem text, as the generator stored it)")
    peer_source: str = Field(default="prefetch", description="how peer groups arrive (graft-train's peers.source): "
                             "prefetch (the lookup runs while verl generates) or cotrain (the run publishes its groups and "
                             "waits for its co-trainer's); lockstep and replay are refused")
    lookup_wait_s: float | None = Field(default=None, ge=0.0, description="prefetch: after generation, wait at most "
                                        "this long (one deadline per step) for the batch's peer lookup, which runs while "
                                        "verl generates; 0: graft only what is back; None: graft-train's "
                                        "peers.lookup_wait_s (30 s). A step whose lookup was later trains as GRPO "
                                        "(graft/store_lookups_late; a warning after a few such steps in a row)")
    publish: bool | None = Field(default=None, description="push this run's own groups to the store, in the background: "
                                 "the sampled token ids, their behaviour logprobs (rollout_log_probs: the mode the rollout "
                                 "engine ran, said at start), the run's rewards, model id, revision and step (None: the "
                                 "source's way: prefetch does not, cotrain always does)")
    peer_options: dict[str, Any] = Field(default_factory=dict, description="the source's other settings, graft-train's "
                                         "peers.*: cotrain's wait_s, poll_s")
    problem_key: str = Field(default="problem", description="key of each dataset row's extra_info holding its problem "
                             "text (prompt_id(text) is its store id), with reward_model.ground_truth its gold answer: sent "
                             "with the run's wants (store_options.want_misses needs them) and pushed with its groups")
    peer_reward_map: dict[float, float] | None = Field(
        default=None, description="the learner's reward of each stored peer reward (e.g. {0: -1, 1: 1} for a +-1 "
        "reward): grafted rows then carry the mapped stored reward instead of the run's own reward function's score "
        "of their text (the default); required where verl's reward loop cannot score them (a run's own agent loop)")
    options: dict[str, Any] = Field(default_factory=dict, description="graft-train's graft section: kappa, is_cap, "
                                    "token_is, max_grafted_fraction, peer_models, ...")
    store_options: dict[str, Any] = Field(default_factory=dict, description="graft-train's store section but url: "
                                          "token, timeout_s, retries, backoff_*, groups_per_prompt, and the broker's "
                                          "want_misses, max_times_served, serve_order")

    @property
    def grafts(self) -> bool:
        return self.store_url is not None

    def graft_options(self) -> GraftOptions:
        """graft-train's graft section: options and peer_tokenizers (validated)."""
        peer_tokenizers: dict[str, str] | list[str] = self.peer_tokenizers
        if isinstance(peer_tokenizers, list):
            pairs = [entry.split("=", 1) for entry in peer_tokenizers if "=" in entry]
            if pairs and len(pairs) != len(peer_tokenizers):
                raise ValueError(f"graft.peer_tokenizers {peer_tokenizers}: give every entry as ID=DIR or none (DIR "
                                 "alone); +graft.peer_tokenizers.ID=DIR, one override per peer, needs no quoting")
            peer_tokenizers = dict(pairs) if pairs else peer_tokenizers
        return GraftOptions.model_validate({**self.options, "peer_tokenizers": peer_tokenizers})

    def store_options_section(self) -> StoreConfig:
        """graft-train's store section (how peers arrive is graft.peer_source, never a store option)."""
        options = dict(self.store_options)
        if "url" in options:
            raise ValueError("graft.store_options.url: the URL is graft.store_url")
        try:
            return StoreConfig.model_validate({**options, "url": self.store_url})
        except ValueError as error:
            raise ValueError(f"graft.store_options: {error} (the verl trainer's source is graft.peer_source, its wait "
                             "graft.lookup_wait_s, whether it publishes graft.publish)") from None

    def peers_section(self) -> dict[str, Any]:
        """graft-train's peers section: graft.peer_source, graft.lookup_wait_s, graft.publish, graft.peer_options."""
        return host_peers(self.peer_source, self.lookup_wait_s, self.publish, self.peer_options, VERL_SOURCES,
                          VERL_WHY_NOT, VERL_NAMES)


def graft_section(config: DictConfig) -> VerlGraftSection:
    """The config's `graft` section (absent: plain verl)."""
    return VerlGraftSection.model_validate(graft_settings(config))


def graft_settings(config: DictConfig) -> dict[str, Any]:
    """What the config sets under `graft` (nothing: {})."""
    section = config.get("graft", None)
    data = OmegaConf.to_container(section, resolve=True) if section is not None else {}
    return data or {}


def _value(config: DictConfig, path: str, default: Any = None) -> Any:
    value = OmegaConf.select(config, path, default=default)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def check_config(config: DictConfig) -> None:
    """Raise ValueError, naming the setting and why, for verl settings GRAFT cannot work with (the trainer calls this
    before verl starts a worker)."""
    section = graft_section(config)
    if not section.grafts:
        settings = sorted(graft_settings(config))
        if settings:
            raise ValueError(f"graft.{', graft.'.join(settings)} set without graft.store_url: nothing would be "
                             "grafted (set +graft.store_url to the store's URL, or drop the graft settings)")
        return
    graft = section.graft_options()
    section.store_options_section()
    section.peers_section()
    refusals = []
    if _value(config, "algorithm.adv_estimator") != "grpo":
        refusals.append(f"algorithm.adv_estimator={_value(config, 'algorithm.adv_estimator')}: GRAFT replaces whole "
                        "groups and gives them group-relative advantages (graft-train's grpo, or dr_grpo); set "
                        "algorithm.adv_estimator=grpo (with algorithm.norm_adv_by_std_in_grpo=false for Dr. GRPO)")
    if _value(config, "algorithm.rollout_correction.bypass_mode", False):
        refusals.append("algorithm.rollout_correction.bypass_mode=true: pi_old would be the rollout's logprobs, which "
                        "on grafted rows are the peer's (mu~): the PPO ratio would anchor on the peer and b would be 1")
    if _value(config, "algorithm.rollout_correction.rollout_rs") is not None:
        refusals.append("algorithm.rollout_correction.rollout_rs: rejection sampling compares pi_old with the rollout's "
                        "logprobs, which on grafted rows are the peer's: it would reject peer rows for being the peer's")
    if _value(config, "algorithm.rollout_correction.rollout_is_batch_normalize", False):
        refusals.append("algorithm.rollout_correction.rollout_is_batch_normalize=true: the learner rows' weights "
                        "would be normalised over a batch whose grafted rows carry the peer's ratios")
    if _value(config, "algorithm.filter_groups.enable", False):
        refusals.append("algorithm.filter_groups.enable=true (DAPO): the replay buffer evicts all-fail groups while it "
                        "samples, before GRAFT sees them: nothing would be left to graft")
    if _value(config, "algorithm.use_kl_in_reward", False):
        refusals.append("algorithm.use_kl_in_reward=true: the KL penalty shapes every row's rewards before the "
                        "advantages, and grafted rows take the peer group's advantages: it would vanish there unsaid")
    if _value(config, "actor_rollout_ref.actor.use_kl_loss", False) and not graft.kl_on_peer:
        refusals.append("actor_rollout_ref.actor.use_kl_loss=true: verl's KL term covers every token, grafted ones "
                        "too; set +graft.options.kl_on_peer=true to accept that, or use_kl_loss=false")
    loss_mode = _value(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    if loss_mode != "vanilla":
        refusals.append(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}: GRAFT's per-token weight c rides "
                        "in rollout_is_weights, which verl's vanilla loss multiplies after clipping, as graft-train's "
                        "loss does; other losses are not graft-train's")
    agg = _value(config, "actor_rollout_ref.actor.loss_agg_mode", "token-mean")
    if agg not in LOSS_AGG:
        refusals.append(f"actor_rollout_ref.actor.loss_agg_mode={agg}: graft-train's loss has {', '.join(LOSS_AGG)}")
    elif agg == "seq-mean-token-sum-norm" and _value(config, "actor_rollout_ref.actor.loss_scale_factor") is None:
        refusals.append("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm with loss_scale_factor null: "
                        "verl then divides by each micro-batch's padded width, graft-train by the response budget; set "
                        "actor_rollout_ref.actor.loss_scale_factor to data.max_response_length")
    if float(_value(config, "actor_rollout_ref.actor.entropy_coeff", 0) or 0) != 0:
        refusals.append("actor_rollout_ref.actor.entropy_coeff != 0: graft-train's loss has no entropy bonus, and "
                        "verl's would raise the learner's entropy on the peer's tokens too")
    if graft.token_is == "luffy":
        refusals.append("graft.options.token_is=luffy replaces the PPO ratio inside the loss, which verl computes; use "
                        "'tis' or 'none'")
    group_size = int(_value(config, "actor_rollout_ref.rollout.n", 1) or 1)
    if group_size < 2:
        refusals.append(f"actor_rollout_ref.rollout.n={group_size}: GRPO and GRAFT learn from reward differences inside "
                        "a prompt's group of rollouts; set rollout.n to the peers' group size G (graft-generate's "
                        "default is 8), at least 2")
    attention = _value(config, "actor_rollout_ref.model.override_config.attn_implementation", None)
    if attention is None and importlib.util.find_spec("flash_attn") is None:
        refusals.append("actor_rollout_ref.model.override_config.attn_implementation is unset, so verl's actor asks "
                        "transformers for flash_attention_2, and flash-attn is not installed here (verl[vllm] does not "
                        "bring it): add +actor_rollout_ref.model.override_config.attn_implementation=sdpa, or install "
                        "flash-attn")
    if _value(config, "actor_rollout_ref.rollout.enable_rollout_routing_replay", False):
        refusals.append("actor_rollout_ref.rollout.enable_rollout_routing_replay=true: the replayed expert routes are "
                        "the learner's rollout's, and a peer row has none for its tokens")
    if _value(config, "skip.rollout_tq.enable", False):
        refusals.append("skip.rollout_tq.enable=true: verl then replays dumped rollouts without submitting their "
                        "prompts through the trainer, so no peer lookup is started for them")
    if graft.union_all_success:
        refusals.append("graft.options.union_all_success: a union group has more rows than the rollout.n slots verl's "
                        "batch holds for the prompt; leave it off under verl")
    if _value(config, "actor_rollout_ref.rollout.multi_turn.enable", False):
        refusals.append("actor_rollout_ref.rollout.multi_turn.enable=true: a peer group is single-turn text; a "
                        "multi-turn trajectory's turns cannot be replaced by it")
    # verl reads trainer.v1.<mode>.parameter_sync_step, and the trainer runs as mode "sync" (GraftPPOTrainer.__init__)
    for mode in ("sync", TRAINER_MODE):
        sync_steps = _value(config, f"trainer.v1.{mode}.parameter_sync_step", 1)
        if sync_steps != 1:
            refusals.append(f"trainer.v1.{mode}.parameter_sync_step={sync_steps}: several updates per weight sync are "
                            "verl's async trainers' (colocate_async, separate_async); GRAFT runs in the sync trainer")
    agent_loop = _value(config, "actor_rollout_ref.rollout.agent.default_agent_loop", SINGLE_TURN_AGENT)
    agent_configs = _value(config, "actor_rollout_ref.rollout.agent.agent_loop_config_path")
    if section.peer_reward_map is None and (agent_loop != SINGLE_TURN_AGENT or agent_configs is not None):
        refusals.append(f"actor_rollout_ref.rollout.agent (default_agent_loop={agent_loop}, agent_loop_config_path="
                        f"{agent_configs}): grafted rows are scored by the run's reward loop on their text, and an "
                        "agent loop of the run's own may score its rollouts itself; give the learner's reward of each "
                        "stored peer reward in +graft.peer_reward_map (e.g. '+graft.peer_reward_map={0:0,1:1}'), or "
                        f"use verl's {SINGLE_TURN_AGENT}")
    if _value(config, "distillation.enabled", False) or _value(config, "distillation.enable", False):
        refusals.append("distillation: a teacher's logprobs are of the learner's own tokens, which grafted rows replace")
    if refusals:
        raise ValueError("GRAFT cannot run with these verl settings:\n- " + "\n- ".join(refusals))


def train_config(config: DictConfig) -> TrainConfig:
    """graft-train's configuration of the same run: what graft-train's shared functions (the gate, the peer rows, the
    weights, the store client) read, and what the loss parity tests run graft-train's loss with.

    ppo takes verl's clip (clip_ratio_low/high, clip_ratio_c as the dual clip), loss_agg_mode and the KL coefficient;
    rollout.max_response_tokens is data.max_response_length (longer peer texts are dropped, as graft-train drops them)."""
    section = graft_section(config)
    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    clip = _value(config, f"{actor}.clip_ratio", 0.2)
    top_k = _value(config, f"{rollout}.top_k", -1)
    agg = _value(config, f"{actor}.loss_agg_mode", "token-mean")
    use_kl = bool(_value(config, f"{actor}.use_kl_loss", False))
    prompts = int(_value(config, "data.train_batch_size"))
    return TrainConfig.model_validate({
        "seed": int(_value(config, "data.seed") or _value(config, f"{actor}.data_loader_seed", 0) or 0),
        "method": "graft" if section.grafts else "grpo",
        "model": {"path": str(_value(config, "actor_rollout_ref.model.path")), "model_id": section.model_id,
                  "tokenizer_id": section.tokenizer_id},
        "data": {"dataset": "verl-dataset"},
        "rollout": {"group_size": int(_value(config, f"{rollout}.n")), "prompts_per_step": prompts,
                    "temperature": float(_value(config, f"{rollout}.temperature", 1.0)),
                    "top_p": float(_value(config, f"{rollout}.top_p", 1.0)),
                    "top_k": int(top_k) if top_k and int(top_k) > 0 else None,
                    "max_response_tokens": int(_value(config, "data.max_response_length"))},
        "optim": {"lr": float(_value(config, f"{actor}.optim.lr", 1e-6)),
                  "ppo_epochs": int(_value(config, f"{actor}.ppo_epochs", 1)),
                  "mini_batch_prompts": min(prompts, int(_value(config, f"{actor}.ppo_mini_batch_size", prompts)))},
        "ppo": {"eps_low": float(_value(config, f"{actor}.clip_ratio_low", None) or clip),
                "eps_high": float(_value(config, f"{actor}.clip_ratio_high", None) or clip),
                "dual_clip_c": float(_value(config, f"{actor}.clip_ratio_c", 3.0)),
                "kl_beta": float(_value(config, f"{actor}.kl_loss_coef", 0.0)) if use_kl else 0.0,
                "advantage": "grpo" if _value(config, "algorithm.norm_adv_by_std_in_grpo", True) else "dr_grpo",
                **({"loss_agg": agg} if agg in LOSS_AGG else {})},
        "graft": section.graft_options().model_dump(),
        "store": section.store_options_section().model_dump() if section.grafts else {},
        "peers": section.peers_section(),
    })
