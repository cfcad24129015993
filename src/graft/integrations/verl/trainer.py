"""`GraftPPOTrainer`: verl's synchronous v1 trainer (`PPOTrainerSync`), grafting peer groups from the store into its
all-fail groups (docs/algorithm.md), registered as `trainer.v1.trainer_mode=graft_sync`, and a peer of other runs: it can
publish its own groups (graft.publish; graft.peer_source cotrain always does).

It wraps seven of verl's methods and copies none (a copied loop drifts from its parent; HACPO and LUFFY replaced
verl's `fit`); each calls its parent:
- `_submit_batch_to_rollout`: the peer lookup for the submitted prompts (their `extra_info.prompt_id`) starts in a
  background thread, then verl dispatches generation: the lookup hides behind it.           trainer/peers.py
- `_balance_batch`, the first step after the replay buffer's sample (and the colocated reward model) sees the batch
  with every group's rewards (`rm_scores`): the run's own groups are published (publish.py: their rollout_log_probs
  and what they are), in the background, before anything is written over them; the gate on what the run's source
  brings (prefetch: the lookups' answers within the wait; cotrain: the co-trainer's groups, waited for) and the rewards
  (an all-fail group: no reward > 0), the broker's wants and served ledger posted, then each grafted
  group's peer rollouts, re-tokenised into the learner's tokens and scored by the run's own reward (rewards.py), are
  written over the failed group's rows in TransferQueue: as many as the group has (verl keeps a group some of whose
  sessions failed), a seeded pick keeping a success; an unfilled slot keeps one token, masked out, as verl's own
  padding rows. Then verl balances, computes pi_old (and pi_ref) on them itself.  trainer/gate.py, trainer/batch.py
- `_compute_old_log_prob`: verl's; its rollout-vs-actor metrics recomputed over the learner's own rows (on a grafted
  row the sampler is the peer); a grafted row whose peer stored no logprobs gets pi_old as its sampler's (b = 1).
- `_compute_advantage`: verl's, then on grafted rows the peer group's advantages (graft-train's, from the learner's
  rewards of the rows written, negative ones scaled) and the per-token weight c = peer_loss_scale * w * b from pi_old
  and the peer's projected logprobs mu~ (graft-train's `old_logprobs_and_weights`). c goes into `rollout_is_weights`, which
  verl's vanilla loss multiplies into the clipped per-token loss, as graft-train's loss does; the learner's rows keep
  1 (or verl's own rollout correction weight when `rollout_is` is set). It returns TransferQueue's record of the batch
  after that write: `_update_actor` sends the actor the fields that record lists. graft-train's metrics go under
  `graft/`; verl's rollout_corr/* are recomputed over the learner's own rows.
- `_update_actor`: a batch with grafted rows goes to the actor only if the record verl dispatches lists the fields
  GRAFT's weights ride in (`rollout_is_weights`, `advantages`, `loss_mask`, `response_mask`); else it raises.
- `_setup` checks, in the TaskRunner, what GRAFT needs there (preflight.py) and builds the learner's identities, the
  peers' tokenizers and the store client before verl starts its workers; `fit` closes the client.
verl's trainer runs in its own sync mode underneath (`self.trainer_mode` is `sync`; the config, which verl logs, keeps
`graft_sync`): its replay buffer, checkpoints and weight sync are the sync trainer's.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig, open_dict
from tensordict import NonTensorData, TensorDict
from transfer_queue import KVBatchMeta
from verl.protocol import DataProto
from verl.trainer.ppo.padding_utils import build_padding_position_ids
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug.metrics import calculate_debug_metrics
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl.workers.utils.padding import response_to_nested

from graft.integrations.verl import rewards
from graft.integrations.verl.config import TRAINER_MODE, VERL_SOURCES, check_config, graft_section, train_config
from graft.integrations.verl.preflight import preflight, where_this_runs
from graft.integrations.verl.publish import own_rows, problems_of, sampler_logprobs
from graft.rollouts.sampling import SamplingParams
from graft.schemas import NO_LOGPROBS, Problem, trainer_generator_id
from graft.trainer import (
    FirstPass,
    GateDecision,
    GraftHost,
    PeerRowCounts,
    TrainSample,
    WeightedRows,
    WeightStats,
    fit_grafted_group,
    gate_groups,
    gate_tally,
    graft_metrics,
    graft_tally,
    host_setup,
    learner_stop_token,
    old_logprobs_and_weights,
    peer_rows,
)

log = logging.getLogger(__name__)
NAN = float("nan")
# fields of a rollout that carry more than text tokens: a peer row has nothing for them
UNSUPPORTED_FIELDS = ("routed_experts", "teacher_ids", "teacher_logprobs")
# fields of a prompt batch that carry images, video or audio: a peer group is text
MULTI_MODAL_FIELDS = ("multi_modal_data", "multi_modal_inputs", "images", "videos", "audios")
# what verl's actor must receive of a batch with grafted rows: GRAFT's weights c and advantages, and the masks
ACTOR_FIELDS = ("rollout_is_weights", "advantages", "loss_mask", "response_mask")


def row_has_mu(row: TrainSample) -> bool:
    """Whether a grafted row carries its sampler's logprobs mu~ (the verl trainer's one place deciding it): `peer_rows`
    leaves `behaviour_logprobs` None where the stored logprobs are not mu (schemas.mu_is_behaviour)."""
    return row.behaviour_logprobs is not None


@dataclass
class Lookup:
    """One submission's peer lookup, started before verl generates."""

    prompt_of: dict[str, str]  # uid -> store prompt id
    pending: Future | None
    problems: dict[str, Problem] = field(default_factory=dict)  # prompt id -> its problem, where the dataset has it
    started: float = field(default_factory=time.perf_counter)
    open: set[str] = field(init=False)  # uids that may still be sampled (not yet seen in a sampled batch)

    def __post_init__(self):
        self.open = set(self.prompt_of)


@dataclass
class Splice:
    """A batch's gate decisions and the peer rows written over its failed groups (kept for `_compute_advantage`)."""

    decisions: list[GateDecision]
    slots: dict[str, TrainSample | None]  # TransferQueue key -> its peer row (None: the slot keeps no token)
    learner_rewards: list[float]
    gate: dict[str, int]  # the gate's tally (gate_tally)
    store: dict[str, float]  # the store client's counts since the last batch, and this batch's wait
    counts: PeerRowCounts = field(default_factory=PeerRowCounts)  # what became of the peer rollouts
    rows_scored: int = 0  # peer rows given the learner's reward (the run's reward loop, or the map) before the pick
    verdict_changed: int = 0  # written rows whose stored verdict (reward > 0) and the learner's differ
    mu_unknown: list[str] = field(default_factory=list)  # keys of rows without mu~: their sampler's logprobs := pi_old
    splice_s: float = 0.0  # the gate, the peer rows, their rewards and the write (in _balance_batch)
    graft_s: float = 0.0  # splice_s and the weights (in _compute_advantage)


@register_trainer(TRAINER_MODE)
class GraftPPOTrainer(PPOTrainerSync):
    """verl's sync trainer with GRAFT. Without `graft.store_url` it is verl's sync trainer, unchanged."""

    grafts_in_verl = True  # verl's other trainers refuse graft.* (guard.py); this one runs it

    def __init__(self, config: DictConfig):
        check_config(config)  # before verl starts anything: a refused setting fails here, saying why
        self.graft_section = graft_section(config)
        self.graft_cfg = train_config(config) if self.graft_section.grafts else None
        # verl's base constructor reads any mode but "sync" as an async one (self.trainer_mode: its replay buffer,
        # checkpoints, prompt storage): GRAFT runs inside the sync trainer, so verl's constructor sees its own sync
        # mode; the config, which verl logs, keeps this trainer's name
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        try:
            super().__init__(config)
        finally:
            with open_dict(config):
                config.trainer.v1.trainer_mode = TRAINER_MODE
        self.graft: GraftHost | None = None
        self.graft_lookups: list[Lookup] = []
        self.graft_splice: Splice | None = None
        self.graft_publishing: tuple[SamplingParams, str] | None = None  # what the rollout ran, what its logprobs are

    # ---- set-up -------------------------------------------------------------------------------------------------
    def _setup(self):
        if self.graft_cfg is not None:
            # in the TaskRunner, before verl starts its workers: what GRAFT needs on this node fails here, cheaply
            self._init_tokenizer()  # verl's (its _setup begins with it): the learner's tokenizer
            self.graft = self.graft_setup()
        super()._setup()

    def graft_setup(self) -> GraftHost:
        """The preflight (preflight.py), then the learner's identities (verl's tokenizer: the one its actor trains
        with), the peers' tokenizers and the store client. Needs `self.tokenizer` (verl's `_init_tokenizer`)."""
        preflight(self.graft_cfg.store)
        eos_ids = {int(self.tokenizer.eos_token_id)} if self.tokenizer.eos_token_id is not None else set()
        stop = learner_stop_token(self.tokenizer, eos_ids, "auto")  # verl prompts through the chat template
        try:
            host = host_setup(self.graft_cfg, self.tokenizer, eos_ids=eos_ids | {stop},
                              device=torch.device("cpu"), stop_token_id=stop,  # no model: verl's actor has it
                              runs=VERL_SOURCES,
                              generator_id=trainer_generator_id("verl", self.config.trainer.experiment_name))
        except OSError as exc:  # a peer tokenizer's directory: it must resolve where verl's TaskRunner runs
            raise FileNotFoundError(f"{exc} (where verl's TaskRunner runs: {where_this_runs()})") from exc
        if self.graft_cfg.publishes:
            params, mode, why = sampler_logprobs(self.config)
            self.graft_publishing = (params, mode)
            (log.warning if mode == NO_LOGPROBS else log.info)(
                "GRAFT publishing: this run's groups go to the store %s as model %s, with behaviour logprobs %s",
                self.graft_cfg.store.url, host.learner.model_id, why)
        return host

    def fit(self, agent_loop_manager):
        try:
            return super().fit(agent_loop_manager)
        finally:
            if self.graft is not None:
                self.graft.peers.finish(timeout_s=self.graft.cfg.store.timeout_s)  # deliver what waits, or say it
                self.graft.peers.close()

    @property
    def graft_policy_step(self) -> int:
        """The step of the policy that samples this step (verl counts steps from 1: step g samples after g - 1
        updates), as graft-train numbers it: its groups' policy_step, its lookups' learner step."""
        return max(0, self.global_steps - 1)

    # ---- 1. the lookup, while verl generates -------------------------------------------------------------------
    def _submit_batch_to_rollout(self, batch: TensorDict) -> int:
        if self.graft is not None:
            self.graft_start_lookup(batch)
        return super()._submit_batch_to_rollout(batch)

    def graft_start_lookup(self, batch: TensorDict) -> Lookup:
        """Start the lookup of the batch's prompts (each row's `extra_info[prompt_id_key]`)."""
        key = self.graft_section.prompt_id_key
        extra = list(batch["extra_info"]) if "extra_info" in batch.keys() else [{}] * len(batch)
        missing = [i for i, info in enumerate(extra) if not isinstance(info, dict) or key not in info]
        if missing:
            raise KeyError(f"GRAFT finds peer groups by each prompt's store id: rows {missing[:5]} of the dataset have "
                           f"no extra_info.{key} (add schemas.prompt_id(problem text) to each row's extra_info, or "
                           "name the key in graft.prompt_id_key)")
        images = [name for name in MULTI_MODAL_FIELDS if name in batch.keys() and any(_plain(v) for v in batch[name])]
        if images:
            raise NotImplementedError(f"GRAFT grafts text completions; this batch's prompts carry {images}: a peer's text "
                                      "group cannot stand in for a multi-modal trajectory")
        prompt_of = {str(uid): str(info[key]) for uid, info in zip(list(batch["uid"]), extra, strict=True)}
        reward_models = list(batch["reward_model"]) if "reward_model" in batch.keys() else [None] * len(extra)
        problems = problems_of(extra, reward_models, key, self.graft_section.problem_key, self.graft.cfg.data.dataset,
                               required=self.graft.cfg.store.want_misses)
        request = self.graft.peers.request(list(prompt_of.values()), self.graft_policy_step)
        lookup = Lookup(prompt_of, self.graft.peers.start_lookup(request), problems)
        self.graft_lookups.append(lookup)
        return lookup

    # ---- 2. the gate and the splice, before verl balances the batch ---------------------------------------------
    def _balance_batch(self, batch: KVBatchMeta, metrics, *args, **kwargs):
        if self.graft is not None and batch.partition_id == "train":
            self.graft_splice = self.graft_splice_batch(batch)
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    def graft_splice_batch(self, batch: KVBatchMeta) -> Splice:
        """Gate the batch's groups and write the grafted groups' peer rows over their rows in TransferQueue."""
        began = time.perf_counter()
        groups: dict[str, list[int]] = {}  # uid -> its rows (batch indices), in session order
        for i, key in enumerate(batch.keys):
            uid, session, index = key.rsplit("_", 2)
            if int(index) != 0:
                raise NotImplementedError(f"trajectory {key}: GRAFT replaces single-output trajectories; this agent "
                                          "loop returns several outputs per session")
            groups.setdefault(uid, []).append(i)
        for rows in groups.values():
            rows.sort(key=lambda i: int(batch.keys[i].rsplit("_", 2)[1]))
        scores = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rm_scores"])
        rewards = [float(row.sum()) for row in scores["rm_scores"].unbind()]  # verl's reward: rm_scores' sum

        lookups = self.graft_lookups_of(list(groups))
        prompt_of = {uid: prompt for lookup in lookups for uid, prompt in lookup.prompt_of.items()}
        problems = {prompt: problem for lookup in lookups for prompt, problem in lookup.problems.items()}
        unknown = [uid for uid in groups if uid not in prompt_of]
        if unknown:
            raise RuntimeError(f"groups {unknown[:3]} were not submitted through this trainer: no prompt id is known")
        learner_rewards = [(prompt_of[uid], [rewards[i] for i in rows]) for uid, rows in groups.items()]
        if self.graft_publishing is not None:  # before the wait for a co-trainer's groups, and before the splice
            self.graft_publish(batch, groups, prompt_of, rewards, problems)
        step, peers = self.graft_policy_step, self.graft.peers
        request = peers.request([prompt for prompt, _ in learner_rewards], step)
        found = peers.candidates([lookup.pending for lookup in lookups], request, learner_rewards,
                                 self.graft.refused.usable, step)  # one wait for the step, however many lookups
        self.graft_free_lookups()
        decisions = gate_groups(
            learner_rewards, found.groups, request, max_grafted_fraction=self.graft.cfg.graft.max_grafted_fraction,
            rng=random.Random(self.graft.cfg.seed * 7_919 + self.global_steps),  # graft-train's seeding of the cap
            usable_tokenizers=self.graft.refused.usable, trust_unverified_mu=self.graft.cfg.graft.trust_unverified_mu,
        )
        self.graft.refused.warn(decisions, found.groups)
        peers.after_gate(step, decisions, found, problems, learner_rewards)  # the broker's wants and served ledger
        splice = Splice(decisions, {}, rewards, gate_tally(decisions, found),
                        {**self.graft.store.take(), "store_wait_s": found.wait_s})
        grafted = [(uid, rows, d) for (uid, rows), d in zip(groups.items(), decisions, strict=True) if d.grafts]
        if grafted:
            self.graft_write_rows(batch, grafted, splice)
        splice.splice_s = splice.graft_s = time.perf_counter() - began
        return splice

    def graft_lookups_of(self, uids: list[str]) -> list[Lookup]:
        """The lookups started for `uids` (a step's prompts may span several submissions); those uids leave them."""
        wanted = set(uids)
        lookups = [lookup for lookup in self.graft_lookups if wanted & lookup.prompt_of.keys()]
        for lookup in lookups:
            lookup.open -= wanted
        return lookups

    def graft_publish(self, batch: KVBatchMeta, groups: dict[str, list[int]], prompt_of: dict[str, str],
                      rewards: list[float], problems: dict[str, Problem]) -> None:
        """The batch's own groups, as the rollout sampled them, to the store in the background (publish.py)."""
        params, mode = self.graft_publishing
        rows = own_rows(batch, groups, rewards, self.tokenizer, self.graft.learner.eos_ids, mode)
        self.graft.publish_own([(prompt_of[uid], rows[uid]) for uid in groups], self.graft_policy_step,
                               params, mode, problems)

    def graft_free_lookups(self) -> None:
        """Drop the lookups none of whose prompts can still be sampled: each was either in a sampled batch or left
        TransferQueue without one (a prompt whose sessions all failed has no trajectory; verl's replay buffer consumes
        it, or evicts it to refill, all the same)."""
        if any(lookup.open for lookup in self.graft_lookups):
            live = set(tq.kv_list(partition_id="train").get("train", {}))  # prompt uids (and trajectories) still there
            for lookup in self.graft_lookups:
                lookup.open &= live
        for lookup in self.graft_lookups:
            if not lookup.open and lookup.pending is not None:
                lookup.pending.cancel()  # one no prompt of which was sampled is still running: its answer is not needed
        self.graft_lookups = [lookup for lookup in self.graft_lookups if lookup.open]

    def graft_write_rows(self, batch: KVBatchMeta, grafted: list[tuple[str, list[int], GateDecision]],
                         splice: Splice) -> None:
        """Peer rows over the grafted groups' slots: verl's own fields of each row, rebuilt from the peer's tokens (as
        verl's padding rows are built from a real row, trainer/ppo/padding_utils.py), the tags' lengths updated.

        A group has as many slots as verl kept trajectories of it (rollout.n, fewer when some of its sessions failed):
        its peer rows, scored by the learner's reward, are picked for those slots (a seeded pick keeping a success and a
        failure) and their advantages computed over the rows written (graft-train's `fit_grafted_group`)."""
        cfg, learner = self.graft.cfg, self.graft.learner
        keys = [batch.keys[i] for _, rows, _ in grafted for i in rows]
        sources = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id)
        unsupported = [name for name in UNSUPPORTED_FIELDS if name in sources.keys()]
        if unsupported:
            raise NotImplementedError(f"GRAFT grafts text completions; these rollouts also carry {unsupported}, for "
                                      "which peer rows have nothing")
        position = {key: k for k, key in enumerate(keys)}
        firsts = [sources[position[batch.keys[rows[0]]]] for _, rows, _ in grafted]
        prompts = [source["prompts"].tolist() for source in firsts]
        # every peer rollout re-tokenised (`group` keeps each group's own centring under group_normalized_weight)
        made = [peer_rows(cfg, learner, list(d.peer_group.rollouts), d.peer_group.prompt_id, group, prompt,
                          self.graft.peer_tokenizers, learner.stop_token_id, splice.counts)
                for group, ((_, _, d), prompt) in enumerate(zip(grafted, prompts, strict=True))]
        stored = self.graft_learner_rewards(made, prompts, firsts, splice)
        samples, tags = [], []
        for group, ((_, rows, decision), group_rows) in enumerate(zip(grafted, made, strict=True)):
            peer = decision.peer_group
            splice.counts.peer_rollouts_unused += max(0, len(peer.rollouts) - len(rows))
            kept = fit_grafted_group(cfg, peer, group_rows, splice.counts, max_rows=len(rows),
                                     pick_seed=cfg.seed * 7_919 + self.global_steps)
            splice.verdict_changed += sum((stored[id(row)] > 0) != (row.reward > 0) for row in kept)
            for slot, i in enumerate(rows):
                row = kept[slot] if slot < len(kept) else None
                key = batch.keys[i]
                splice.slots[key] = row
                sample, tag = self.graft_row_fields(sources[position[key]], batch.tags[i], prompts[group], row,
                                                    row.reward if row is not None else 0.0)
                if row is not None and not row_has_mu(row) and "rollout_log_probs" in sample:
                    splice.mu_unknown.append(key)
                samples.append(sample)
                tags.append(tag)
                batch.tags[i] = tag  # what verl's balancing reads
        tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(samples),
                        tags=tags)

    def graft_learner_rewards(self, made: list[list[TrainSample]], prompts: list[list[int]], sources: list[TensorDict],
                              splice: Splice) -> dict[int, float]:
        """Each peer row's reward set to the learner's (rewards.py: the run's reward loop on its text, or
        graft.peer_reward_map); returns the stored ones, by row."""
        rows = [row for group_rows in made for row in group_rows]
        stored = {id(row): float(row.reward or 0.0) for row in rows}
        if not rows:
            return stored
        mapping = self.graft_section.peer_reward_map
        if mapping is not None:
            learner_rewards = rewards.mapped(rows, mapping)
        else:
            per_row = [(prompt, source) for prompt, source, group_rows in zip(prompts, sources, made, strict=True)
                       for _ in group_rows]
            pad = self.tokenizer.pad_token_id
            learner_rewards = rewards.rescore(self.reward_loop_manager, [p for p, _ in per_row], rows,
                                              [source for _, source in per_row],
                                              pad if pad is not None else self.graft.learner.stop_token_id)
        for row, reward in zip(rows, learner_rewards, strict=True):
            row.reward = float(reward)
        splice.rows_scored += len(rows)
        return stored

    def graft_row_fields(self, source: TensorDict, tag: dict, prompt: list[int], row: TrainSample | None,
                         reward: float) -> tuple[dict, dict]:
        """A failed row's fields and tag with the peer row's tokens in place of its completion (None: one stop token,
        masked out, as verl's padding rows carry)."""
        sample = {name: value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                  for name, value in source.items()}
        if any(_plain(sample.get(name)) for name in MULTI_MODAL_FIELDS):
            raise NotImplementedError("GRAFT grafts text completions; this prompt has multi-modal inputs")
        if row is None:
            completion, mask, behaviour = [self.graft.learner.stop_token_id], [0], [0.0]
        else:
            completion, mask, behaviour = row.completion_ids, [1] * len(row.completion_ids), row.behaviour_logprobs
            if not row_has_mu(row):  # unknown, not log 1: pi_old takes its place once verl has it
                behaviour = [NAN] * len(completion)  # (graft_unknown_mu_as_pi_old)
        responses = torch.tensor(completion, dtype=torch.int64)
        input_ids = torch.cat([torch.tensor(prompt, dtype=torch.int64), responses])
        attention_mask = torch.ones_like(input_ids)
        response_mask = torch.tensor(mask, dtype=torch.int64)
        rm_scores = torch.zeros(len(completion), dtype=torch.float32)
        rm_scores[-1] = reward  # verl's convention: the reward on the last token
        sample.update(responses=responses, input_ids=input_ids, response_mask=response_mask, rm_scores=rm_scores,
                      position_ids=build_padding_position_ids(sample.get("position_ids"), attention_mask))
        if "loss_mask" in sample:
            sample["loss_mask"] = response_mask.clone()
        if "attention_mask" in sample:
            sample["attention_mask"] = attention_mask
        if "rollout_log_probs" in sample:  # the behaviour policy of these tokens: the peer's, projected (mu~)
            sample["rollout_log_probs"] = torch.tensor(behaviour, dtype=torch.float32)
        tag = dict(tag, response_len=len(completion), seq_len=len(prompt) + len(completion),
                   graft="peer" if row is not None else "empty")
        if row is None:
            tag["is_padding"] = True  # no token: out of verl's response-length and score metrics, as its padding rows
        return sample, tag

    # ---- 3. pi_old: verl's; its rollout-vs-actor metrics over the learner's own rows -----------------------------
    def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        before = set(metrics)
        batch = super()._compute_old_log_prob(batch, metrics)
        if self.graft_grafted(batch):
            # verl's training/rollout_probs_diff_* compare the sampler's logprobs with pi_old: on a grafted row those
            # are the peer's (mu~), so the comparison would measure the peer, not verl's rollout engine
            own = self.graft_own_rows(batch, self.graft_splice,
                                      ["responses", "rollout_log_probs", "old_log_probs", "response_mask"])
            added = [name for name in metrics if name not in before and name.startswith("training/rollout_")]
            for name in added:
                del metrics[name]
            if added and own is not None:
                metrics.update(calculate_debug_metrics(DataProto(batch=own)))
            self.graft_unknown_mu_as_pi_old(batch, self.graft_splice)
        return batch

    @staticmethod
    def graft_unknown_mu_as_pi_old(batch: KVBatchMeta, splice: Splice) -> None:
        """Grafted rows whose peer stored no logprobs: pi_old as their sampler's logprobs, so that every ratio against
        them is 1 (b = 1, docs/algorithm.md section 11), instead of a made-up value."""
        if not splice.mu_unknown:
            return
        keys = splice.mu_unknown
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["old_log_probs"])
        tq.kv_batch_put(keys=keys, partition_id=batch.partition_id,
                        fields=TensorDict({"rollout_log_probs": data["old_log_probs"]}, batch_size=len(keys)))

    # ---- 4. advantages and c, after verl computed pi_old and its own advantages ---------------------------------
    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        before = set(metrics)
        batch = super()._compute_advantage(batch, metrics)
        splice, self.graft_splice = self.graft_splice, None
        if self.graft is not None and splice is not None:
            began = time.perf_counter()
            weighted = None
            if splice.slots:
                self.graft_own_rollout_corr(batch, splice, metrics, [name for name in metrics if name not in before])
                # the meta that goes on to the actor: its field list must hold rollout_is_weights, or verl's
                # _update_actor dispatches the batch without them (TransferQueue's meta lists the fields it carries)
                batch, weighted = self.graft_weigh(batch, splice)
            splice.graft_s += time.perf_counter() - began
            metrics.update(self.graft_metrics(splice, weighted))
        return batch

    # ---- 5. the actor: the weights must travel with the batch verl dispatches ----------------------------------
    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        if self.graft is not None and any(tag.get("graft") == "peer" for tag in batch.tags):
            self.graft_check_actor_fields(batch)
        return super()._update_actor(batch, metrics)

    @staticmethod
    def graft_check_actor_fields(batch: KVBatchMeta) -> None:
        """Raise unless the record verl's dispatch reads the actor's batch from lists every field GRAFT's update needs
        (verl's own conversion, as its tqbridge runs it on the workers)."""
        from verl.utils.transferqueue_utils import kv_batch_meta2batch_meta

        sent = set(kv_batch_meta2batch_meta(batch).field_names)
        missing = [name for name in ACTOR_FIELDS if name not in sent]
        if missing:
            raise RuntimeError(f"GRAFT: the batch verl hands its actor has no {missing}: the grafted rows' weights and "
                               f"advantages would not reach its loss (the record lists {sorted(sent)})")

    def graft_grafted(self, batch: KVBatchMeta) -> bool:
        """Whether this batch holds grafted rows (the splice of the batch verl is working on)."""
        return self.graft is not None and self.graft_splice is not None and any(
            key in self.graft_splice.slots for key in batch.keys)

    @staticmethod
    def graft_own_rows(batch: KVBatchMeta, splice: Splice, fields: list[str]) -> TensorDict | None:
        """`fields` of the learner's own rows (neither grafted nor padding), padded; None when there are none."""
        keys = [key for key, tag in zip(batch.keys, batch.tags) if key not in splice.slots and not tag.get("is_padding")]
        if not keys:
            return None
        return tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()

    def graft_own_rollout_corr(self, batch: KVBatchMeta, splice: Splice, metrics: dict, added: list[str]) -> None:
        """verl's rollout_corr/* metrics (pi_old against the sampler's logprobs) over the learner's own rows: on grafted
        rows the sampler is the peer. verl's own function, on those rows, as its _compute_advantage calls it."""
        names = [name for name in added if name.startswith("rollout_corr/")]
        if not names:
            return
        for name in names:
            del metrics[name]
        own = self.graft_own_rows(batch, splice, ["old_log_probs", "rollout_log_probs", "response_mask"])
        if own is None:
            return
        settings = self.config.algorithm.rollout_correction
        _, _, own_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=own["old_log_probs"].float(), rollout_log_prob=own["rollout_log_probs"].float(),
            response_mask=own["response_mask"], rollout_is=settings.get("rollout_is", None),
            rollout_is_threshold=settings.get("rollout_is_threshold", 2.0), rollout_is_batch_normalize=False,
            rollout_rs=None, rollout_rs_threshold=None)  # the two refused settings (integrations/verl/config.py)
        metrics.update(own_metrics)

    def graft_weigh(self, batch: KVBatchMeta, splice: Splice) -> tuple[KVBatchMeta, WeightedRows]:
        """Peer advantages and c = peer_loss_scale * w * b on the grafted rows (graft-train's functions, pi_old as the
        "first pass"); `rollout_is_weights` of every row written (1, or verl's own, on the learner's rows). Returns
        TransferQueue's meta of the batch after that write (it lists rollout_is_weights) and the weighted rows."""
        fields = ["response_mask", "advantages", "old_log_probs", "rollout_is_weights"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        response_mask = data["response_mask"]  # nested (B, j)
        padded = data.select(*[name for name in fields if name in data.keys()]).to_padded_tensor()
        mask = padded["response_mask"].bool()  # (B, T)
        advantages = padded["advantages"].float()  # (B, T) verl's
        weights = padded["rollout_is_weights"].float() if "rollout_is_weights" in padded.keys() \
            else torch.ones_like(advantages)  # (B, T): c of the learner's rows
        index = {key: i for i, key in enumerate(batch.keys)}
        filled = sorted((index[key], row) for key, row in splice.slots.items() if row is not None)
        rows = [row for _, row in filled]
        old = padded["old_log_probs"].float()[[i for i, _ in filled]] if filled else torch.zeros((0, 1))  # (b, T)
        weighted = old_logprobs_and_weights(self.graft.cfg, self.graft.learner, None, rows, FirstPass(rows, None, old))
        kept = {id(row) for row in weighted.rows}
        for key, row in splice.slots.items():
            i = index[key]
            advantages[i], weights[i] = 0.0, 0.0
            if row is None or id(row) not in kept:  # an empty slot, or pi_old / w not finite: dropped, no token
                mask[i] = False
                continue
            count = len(row.completion_ids)
            advantages[i, :count] = row.advantage
            weights[i, :count] = row.token_weight
        advantages = advantages * mask
        output = TensorDict({
            "advantages": response_to_nested(advantages, response_mask),
            "returns": response_to_nested(advantages, response_mask),
            "rollout_is_weights": response_to_nested(weights * mask, response_mask),
            "response_mask": response_to_nested(mask.long(), response_mask),
        }, batch_size=len(batch))
        output["loss_mask"] = output["response_mask"]
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output), weighted

    # ---- metrics -----------------------------------------------------------------------------------------------
    def graft_metrics(self, splice: Splice, weighted: WeightedRows | None) -> dict[str, float]:
        """graft-train's metrics of the batch, under graft/ (verl's own reward metrics cover the trained rows, grafted
        ones included: graft/learner_reward_mean is the learner's own)."""
        grafted_rows = [row for row in (weighted.rows if weighted is not None else []) if row.grafted]
        tally = graft_tally(splice.decisions, splice.counts, self.global_steps, gate=splice.gate,
                            consumed=len(grafted_rows), without_mu=sum(row.without_mu for row in grafted_rows),
                            dropped_non_finite=weighted.dropped_non_finite if weighted is not None else 0)
        metrics = {
            "learner_reward_mean": float(np.mean(splice.learner_rewards)) if splice.learner_rewards else NAN,
            **graft_metrics(tally, weighted.stats if weighted is not None else WeightStats(), host=True),
            **splice.store,
            "peer_rows_scored": splice.rows_scored,
            "peer_rows_verdict_changed": splice.verdict_changed,
            "splice_s": splice.splice_s,
            "graft_s": splice.graft_s,
        }
        return {f"graft/{name}": float(value) for name, value in metrics.items()}


def _plain(value: Any) -> Any:
    """A TensorDict entry's value (a non-tensor entry comes wrapped in NonTensorData)."""
    return value.data if isinstance(value, NonTensorData) else value
