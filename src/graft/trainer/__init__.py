"""GRAFT trainer: GRPO/GRAFT loss, gate, re-tokenisation, peer prefetch, training loop, graft-train.

Its face: what graft-train's loop shares with the trainers that host GRAFT (integrations/trl, integrations/verl), which
import it from here only (tests/layout/test_trainer.py). Imported on first use, as TRL's own `__init__` does: `graft-train
--help` and the config's readers load no torch or transformers. Type checkers and editors read the same names from the
imports under TYPE_CHECKING, which a test holds equal to `_FACE` and `__all__`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_FACE = {
    "graft.trainer.config": ("GraftOptions", "StoreConfig", "TrainConfig", "host_peers"),
    "graft.trainer.loop": ("train",),
    "graft.trainer.host": ("GraftHost", "OwnRow", "host_setup"),
    "graft.trainer.gate": ("GateDecision", "gate_groups", "gate_tally"),
    "graft.trainer.store_link": ("LookupResult",),
    "graft.trainer.retokenize": ("learner_stop_token",),
    "graft.trainer.batch": ("FirstPass", "PeerRowCounts", "TrainSample", "WeightStats", "WeightedRows",
                            "fit_grafted_group", "grafted_group_rows", "old_logprobs_and_weights", "peer_rows"),
    "graft.trainer.metrics": ("graft_metrics", "graft_tally"),
}
__all__ = [  # _FACE's names, written out for the tools that read __all__ (a test holds the two equal)
    "FirstPass", "GateDecision", "GraftHost", "GraftOptions", "LookupResult", "OwnRow", "PeerRowCounts", "StoreConfig",
    "TrainConfig", "TrainSample", "WeightStats", "WeightedRows", "gate_groups", "gate_tally", "graft_metrics",
    "graft_tally", "fit_grafted_group", "grafted_group_rows", "host_peers", "host_setup", "learner_stop_token",
    "old_logprobs_and_weights", "peer_rows", "train",
]

if TYPE_CHECKING:
    from graft.trainer.batch import (
        FirstPass,
        PeerRowCounts,
        TrainSample,
        WeightedRows,
        WeightStats,
        fit_grafted_group,
        grafted_group_rows,
        old_logprobs_and_weights,
        peer_rows,
    )
    from graft.trainer.config import GraftOptions, StoreConfig, TrainConfig, host_peers
    from graft.trainer.gate import GateDecision, gate_groups, gate_tally
    from graft.trainer.host import GraftHost, OwnRow, host_setup
    from graft.trainer.loop import train
    from graft.trainer.metrics import graft_metrics, graft_tally
    from graft.trainer.store_link import LookupResult
    from graft.trainer.retokenize import learner_stop_token


def __getattr__(name: str) -> Any:
    for module, names in _FACE.items():
        if name in names:
            value = getattr(importlib.import_module(module), name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'graft.trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
