"""GRAFT inside another framework's trainer (TRL's GRPOTrainer, verl's PPO trainer): what it builds once, beside the
framework's own model and tokenizer. Per batch the hosts then call graft-train's own functions (`gate_groups`,
`grafted_group_rows`, `old_logprobs_and_weights`) and log `graft_metrics` of a `graft_tally`, as graft-train does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graft.rollouts.models import default_model_id, model_fingerprint, tokenizer_fingerprint
from graft.trainer.config import TrainConfig
from graft.trainer.data import load_peer_tokenizers
from graft.trainer.gate import RefusedTokenizers
from graft.trainer.learner import Learner
from graft.trainer.metrics import StoreCounts
from graft.trainer.peers import PeerSource, make_source


@dataclass
class GraftHost:
    """What every batch's GRAFT works with inside a host trainer (built once, by `host_setup`)."""

    cfg: TrainConfig  # graft-train's configuration of this run (the host's settings, field for field)
    learner: Learner  # the learner's identities as graft-train's shared functions take them
    peer_tokenizers: dict[str, Any]  # tokenizer id -> the peer's tokenizer (graft.peer_tokenizers)
    refused: RefusedTokenizers  # warns once per tokenizer id whose peer groups the gate refused
    peers: PeerSource | None  # where peer groups come from (None on a process that does not talk to the store)
    store: StoreCounts  # the store client's counts since the last batch, under graft-train's store_* names


def host_setup(
    cfg: TrainConfig, model_name: str, tokenizer: Any, *, eos_ids: set[int], device: torch.device,
    hf_model: torch.nn.Module | None = None, stop_token_id: int | None = None, talks_to_store: bool = True,
    runs: tuple[str, ...] = ("prefetch",),
) -> GraftHost:
    """The learner's identities (the host's tokenizer: the one its policy trains with; model_name: a directory, whose
    contents fingerprint the revision, or a hub name), the peers' tokenizers and the store client. hf_model: the host's
    policy where GRAFT runs forward passes itself (TRL), None where the host does (verl); stop_token_id: what the
    learner's completions end with (None: its EOS); talks_to_store: False on the processes that only take the main
    process's decisions; runs: the peer sources (peers.source) the host's trainer runs, the others refused."""
    tokenizer_id = cfg.model.tokenizer_id or tokenizer_fingerprint(tokenizer)
    model_id = cfg.model.model_id or default_model_id(model_name)
    revision = model_fingerprint(model_name) if Path(model_name).is_dir() else model_name
    learner = Learner(hf_model=hf_model, tokenizer=tokenizer, model_id=model_id, tokenizer_id=tokenizer_id,
                      revision=revision, eos_ids=eos_ids, device=device, stop_token_id=stop_token_id)
    peer_tokenizers = load_peer_tokenizers(cfg)
    # None: any tokenizer (the uniform projection opted in); else the learner's and the configured peers'
    refused = RefusedTokenizers(None if cfg.graft.uniform_projection else {tokenizer_id, *peer_tokenizers})
    peers = make_source(cfg, model_id, runs=runs) if talks_to_store else None
    return GraftHost(cfg, learner, peer_tokenizers, refused, peers, StoreCounts(peers.link if peers is not None else None))
