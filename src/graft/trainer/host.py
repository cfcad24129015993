"""GRAFT's parts beside a learner, built once: inside another framework's trainer (TRL's GRPOTrainer, verl's PPO
trainer), beside the framework's own model and tokenizer, and in graft-train, beside its own. Per batch the hosts
then call graft-train's own functions (`gate_groups`, `grafted_group_rows`, `old_logprobs_and_weights`) and its source
of peer groups (graft.trainer.peers: the lookup, the co-training waits, the broker's posts), log `graft_metrics` of a
`graft_tally`, as graft-train does, and publish their own groups as stored groups (`GraftHost.publish_own`:
graft-train's outbox, in the background)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from graft.rollouts.groups import PromptRef, assemble_group, make_group_id
from graft.rollouts.sampling import Sample, SamplingParams
from graft.rollouts.scoring import Score
from graft.schemas import NO_LOGPROBS, Problem, RolloutGroup
from graft.trainer.config import TrainConfig
from graft.trainer.data import load_peer_tokenizers
from graft.trainer.gate import RefusedTokenizers
from graft.trainer.learner import Learner, learner_identity
from graft.trainer.metrics import StoreCounts
from graft.trainer.peers import PeerSource, make_source

log = logging.getLogger(__name__)


@dataclass
class OwnRow:
    """One of the host's own rollouts as its sampler gave it, for the store."""

    token_ids: list[int]  # the sampled completion (a finished one ends with its stop token)
    logprobs: list[float] | None  # the sampler's logprob of each token (None: the host has none)
    text: str  # decoded, special tokens left out
    finished: bool  # ended with a stop token (else cut at the length budget)
    reward: float | None  # the run's reward of it (the store keeps rewards in [0, 1]; None: unscorable)


@dataclass
class GraftHost:
    """What every batch's GRAFT works with beside the learner (built once: `host_setup` in a host trainer,
    `GraftHost.around` in graft-train, which loads its learner itself)."""

    cfg: TrainConfig  # graft-train's configuration of this run (the host's settings, field for field)
    learner: Learner  # the learner's identities as graft-train's shared functions take them
    peer_tokenizers: dict[str, Any]  # tokenizer id -> the peer's tokenizer (graft.peer_tokenizers)
    refused: RefusedTokenizers  # warns once per tokenizer id whose peer groups the gate refused
    peers: PeerSource | None  # where peer groups come from (None on a process that does not talk to the store)
    store: StoreCounts  # the store client's counts since the last batch, under graft-train's store_* names
    generator_id: str = ""  # what the run's published groups name as their generator ("trl:<output dir>", ...)
    said_unpublishable: bool = False

    def publish_own(self, groups: list[tuple[str, list[OwnRow]]], policy_step: int, params: SamplingParams,
                    logprobs_mode: str, problems: dict[str, Problem]) -> list[RolloutGroup]:
        """The host's own groups of a step (prompt id, its rows, in the batch's order) as stored groups, queued for the
        store and pushed in the background (graft-train's outbox: the step never waits for the store), when the run's
        source publishes. `params`: what the sampler sampled with; `logprobs_mode`: what its logprobs are
        (processed_logprobs, raw_logprobs, or none), stored with the rows, whose mu follows from them
        (schemas.mu_is_behaviour); a group with a row without finite logprobs is stored without mu. A group that is
        no stored group (a reward outside [0, 1]) is counted (store_groups_not_publishable) and said once."""
        if self.peers is None or not self.peers.publishes:
            return []
        cfg, learner = self.cfg, self.learner
        built: list[RolloutGroup] = []
        for index, (prompt_id, rows) in enumerate(groups):
            mode = logprobs_mode if all(row.logprobs is not None and all(map(math.isfinite, row.logprobs))
                                        for row in rows) else NO_LOGPROBS
            samples = [Sample(row.token_ids, row.logprobs if mode != NO_LOGPROBS else [], row.text,
                              "stop" if row.finished else "length") for row in rows]
            scores = [Score(row.reward, row.reward is not None and row.reward > 0, None) for row in rows]
            # the run's seed and the host's generator in the key: two runs of one checkpoint publish different groups
            group_id = make_group_id(learner.model_id, f"{learner.revision}/seed={cfg.seed}/{self.generator_id}",
                                     policy_step, prompt_id, index)
            try:
                built.append(assemble_group(
                    problems.get(prompt_id) or PromptRef(prompt_id, cfg.data.dataset), samples, scores,
                    model_id=learner.model_id, model_revision=learner.revision, tokenizer_id=learner.tokenizer_id,
                    policy_step=policy_step, generator_id=self.generator_id, params=params, eos_token_ids=learner.eos_ids,
                    group_id=group_id, std_normalize=cfg.ppo.advantage == "grpo", engine_logprobs_mode=mode))
            except ValueError as error:  # pydantic's ValidationError is one: a row the store would refuse
                self.peers.link.count("groups_not_publishable")
                if not self.said_unpublishable:
                    self.said_unpublishable = True
                    log.warning("GRAFT publishing: the run's group of prompt %s at step %d is not published, nor any "
                                "other like it (metric store_groups_not_publishable): %s", prompt_id, policy_step,
                                " ".join(str(error).split()))
        self.peers.publish(built, [problems.get(group.prompt_id) for group in built])
        return built

    @classmethod
    def around(cls, cfg: TrainConfig, learner: Learner, peers: PeerSource | None, generator_id: str = "") -> GraftHost:
        """The parts every trainer builds around its learner and its source of peer groups: the peers' tokenizers, the
        gate's refusals (None: any tokenizer, the uniform projection opted in; else the learner's and the configured
        peers') and the store counts; generator_id: what the run's published groups name as their generator."""
        peer_tokenizers = load_peer_tokenizers(cfg)
        refused = RefusedTokenizers(None if cfg.graft.uniform_projection else {learner.tokenizer_id, *peer_tokenizers})
        return cls(cfg, learner, peer_tokenizers, refused, peers, StoreCounts(peers.link if peers is not None else None),
                   generator_id)


def host_setup(
    cfg: TrainConfig, tokenizer: Any, *, eos_ids: set[int], device: torch.device,
    hf_model: torch.nn.Module | None = None, stop_token_id: int | None = None, talks_to_store: bool = True,
    runs: tuple[str, ...] = ("prefetch",), generator_id: str = "",
) -> GraftHost:
    """GRAFT's parts in a host trainer: the learner's identities as graft-train gives them (`learner_identity`: the
    host's tokenizer, the one its policy trains with, and cfg.model.path, whose contents fingerprint the revision, or
    a hub name), its source of peer groups and `GraftHost.around`'s parts. hf_model: the host's policy where GRAFT
    runs forward passes itself (TRL), None where the host does (verl); stop_token_id: what the learner's completions
    end with (None: its EOS); talks_to_store: False on the processes that only take the main process's decisions;
    runs: the peer sources (peers.source) the host's trainer runs, the others refused; generator_id: what the run's
    published groups name as their generator."""
    learner = Learner(hf_model=hf_model, tokenizer=tokenizer, **learner_identity(cfg, tokenizer), eos_ids=eos_ids,
                      device=device, stop_token_id=stop_token_id)
    peers = make_source(cfg, learner.model_id, runs=runs) if talks_to_store else None
    return GraftHost.around(cfg, learner, peers, generator_id)
