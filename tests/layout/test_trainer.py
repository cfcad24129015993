"""The trainer's face: the TRL and verl adapters import graft.trainer only through it, it names what it exports,
and GRAFT's tally is spelled in one place for every trainer."""

from __future__ import annotations

import subprocess
from pathlib import Path

from source_tree import ROOT, first_party_modules, imports_past_the_face

TRAINER = "graft.trainer"
ADAPTERS = ("graft.integrations.trl", "graft.integrations.verl")


def _trainer_face() -> set[str]:
    """The names graft.trainer exports (its `__all__`; imported on first use, so importing the package is cheap)."""
    import graft.trainer

    return set(graft.trainer.__all__)


def _adapters() -> dict[str, Path]:
    return {name: path for name, path in first_party_modules().items() if name.startswith(ADAPTERS)}


def test_the_adapters_import_the_trainer_only_through_its_face():
    """Issue 51: TRL's and verl's trainers host graft-train's GRAFT through `from graft.trainer import ...` (its
    `__all__`), never graft.trainer.batch or .metrics: the trainer's modules can move without breaking them, and what
    they share with graft-train (one tally, one metrics function, one setup) is written down in one place."""
    face = _trainer_face()
    assert {"graft_metrics", "graft_tally", "host_setup", "PeerRowCounts", "TrainConfig"} <= face
    assert imports_past_the_face(TRAINER, face, _adapters()) == []


def test_the_trainer_face_rule_finds_an_import_past_it(tmp_path):
    module = tmp_path / "adapter.py"
    module.write_text("from graft.trainer import TrainConfig, gate\nfrom graft.trainer.batch import TrainSample\n"
                      "import graft.trainer.metrics\n")
    found = imports_past_the_face(TRAINER, {"TrainConfig"}, {"graft.integrations.trl.trainer": module})
    assert found == [("graft.integrations.trl.trainer", "graft.trainer.batch"),
                     ("graft.integrations.trl.trainer", "graft.trainer.gate"),
                     ("graft.integrations.trl.trainer", "graft.trainer.metrics")]


def test_the_trainer_face_names_what_it_exports():
    """Every name of graft.trainer's face resolves (the lazy face names no module or name that is gone), and the package
    imports no torch on its own: `graft-train --help` and the configs' readers stay fast."""
    import sys

    code = ("import sys, graft.trainer as t; assert 'torch' not in sys.modules, 'graft.trainer imported torch'; "
            "missing = [n for n in t.__all__ if getattr(t, n, None) is None]; assert not missing, missing")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_one_tally_for_every_trainer():
    """One GRAFT tally (issue 51): the adapters spell none of GRAFT's metric names or counters themselves (a new metric
    was three edits that could drift); graft_tally and graft_metrics do, for graft-train, TRL and verl alike."""
    words = ('"frac_all_fail"', '"peer_hit_rate"', '"frac_dropped_retokenize"', "peer_advantage_mismatch",
             "grafted_groups_short", ".kind ==")
    assert [f"{name}: {word}" for name, path in _adapters().items() for word in words if word in path.read_text()] == []
