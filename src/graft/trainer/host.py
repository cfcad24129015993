"""GRAFT's parts beside a learner, built once: inside another framework's trainer (TRL's GRPOTrainer, verl's PPO
trainer), beside the framework's own model and tokenizer, and in graft-train, beside its own. Per batch the hosts
then call graft-train's own functions (`gate_groups`, `grafted_group_rows`, `old_logprobs_and_weights`) and log
`graft_metrics` of a `graft_tally`, as graft-train does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graft.trainer.config import TrainConfig
from graft.trainer.data import load_peer_tokenizers
from graft.trainer.gate import RefusedTokenizers
from graft.trainer.learner import Learner, learner_identity
from graft.trainer.metrics import StoreCounts
from graft.trainer.peers import PeerSource, make_source


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

    @classmethod
    def around(cls, cfg: TrainConfig, learner: Learner, peers: PeerSource | None) -> GraftHost:
        """The parts every trainer builds around its learner and its source of peer groups: the peers' tokenizers, the
        gate's refusals (None: any tokenizer, the uniform projection opted in; else the learner's and the configured
        peers') and the store counts."""
        peer_tokenizers = load_peer_tokenizers(cfg)
        refused = RefusedTokenizers(None if cfg.graft.uniform_projection else {learner.tokenizer_id, *peer_tokenizers})
        return cls(cfg, learner, peer_tokenizers, refused, peers, StoreCounts(peers.link if peers is not None else None))


def host_setup(
    cfg: TrainConfig, tokenizer: Any, *, eos_ids: set[int], device: torch.device,
    hf_model: torch.nn.Module | None = None, stop_token_id: int | None = None, talks_to_store: bool = True,
    runs: tuple[str, ...] = ("prefetch",),
) -> GraftHost:
    """GRAFT's parts in a host trainer: the learner's identities as graft-train gives them (`learner_identity`: the
    host's tokenizer, the one its policy trains with, and cfg.model.path, whose contents fingerprint the revision, or
    a hub name), its source of peer groups and `GraftHost.around`'s parts. hf_model: the host's policy where GRAFT
    runs forward passes itself (TRL), None where the host does (verl); stop_token_id: what the learner's completions
    end with (None: its EOS); talks_to_store: False on the processes that only take the main process's decisions;
    runs: the peer sources (peers.source) the host's trainer runs, the others refused."""
    learner = Learner(hf_model=hf_model, tokenizer=tokenizer, **learner_identity(cfg, tokenizer), eos_ids=eos_ids,
                      device=device, stop_token_id=stop_token_id)
    peers = make_source(cfg, learner.model_id, runs=runs) if talks_to_store else None
    return GraftHost.around(cfg, learner, peers)
