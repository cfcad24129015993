"""GRAFT trainer: GRPO/GRAFT loss, gate, re-tokenisation, peer prefetch, training loop, graft-train.

Its face: what graft-train's loop shares with the trainers that host GRAFT (integrations/trl, integrations/verl), which
import it from here only (tests/test_layout.py). Imported on first use, as TRL's own `__init__` does: `graft-train
--help` and the config's readers load no torch or transformers."""

from __future__ import annotations

import importlib
from typing import Any

_FACE = {
    "graft.trainer.config": ("GraftConfig", "StoreConfig", "TrainConfig"),
    "graft.trainer.loop": ("train",),
    "graft.trainer.host": ("GraftHost", "host_setup"),
    "graft.trainer.gate": ("GateDecision", "gate_groups", "gate_tally"),
    "graft.trainer.store_link": ("LookupResult",),
    "graft.trainer.retokenize": ("learner_stop_token",),
    "graft.trainer.batch": ("FirstPass", "PeerRowCounts", "TrainSample", "WeightStats", "WeightedRows",
                            "grafted_group_rows", "old_logprobs_and_weights"),
    "graft.trainer.metrics": ("graft_metrics", "graft_tally"),
}
__all__ = [name for names in _FACE.values() for name in names]

def __getattr__(name: str) -> Any:
    for module, names in _FACE.items():
        if name in names:
            value = getattr(importlib.import_module(module), name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'graft.trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
