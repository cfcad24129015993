"""demo.warm_start_curves: the stop rule replayed on a curve stops where train_sft would, and the study writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from demo.config import DemoConfig
from demo.warm_start_curves import RULES, replay

REPO = Path(__file__).resolve().parents[2]


def _row(step: int, add2: float, add3: float) -> dict:
    return {"step": step, "dev": {"add2": add2, "add3": add3}, "held_out": {"add2": add2, "add3": add3 - 0.01}}


def test_replay_needs_each_level_on_its_last_checks():
    cfg = DemoConfig()  # learner: add2 0.9 and add3 0.13
    # a spike of add3 at 30 (the plateau's noise), then add3 held from 50 on while add2 dips below its level at 60
    curve = [_row(10, 0.5, 0.05), _row(20, 0.92, 0.06), _row(30, 0.95, 0.14), _row(40, 0.95, 0.08), _row(50, 0.93, 0.15),
             _row(60, 0.85, 0.2), _row(70, 0.95, 0.3), _row(80, 0.97, 0.4)]
    assert replay(cfg, "learner", curve, 1)["step"] == 30
    # two in a row, per family: add3 on 50 and 60, add2 on 70 and 80 (its dip at 60 restarts its count)
    assert replay(cfg, "learner", curve, 2)["step"] == 80
    never = replay(cfg, "learner", curve[:4], 2)
    assert never["step"] == 40 and never["reached"] is False


def test_the_study_writes_curves_a_table_and_a_plot(tmp_path):
    out, report = tmp_path / "out", tmp_path / "report"
    sets = ["--set", "learner.sft.stop_at=20", "--set", "learner.sft.batch_size=8", "--set", 'task.n_eval={"add2": 6, "add3": 6}',
            "--set", "task.n_dev=6"]
    run = subprocess.run([sys.executable, "-m", "demo.warm_start_curves", "--kernels", "own", *sets, "--out-dir", str(out),
                          "--report-dir", str(report)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((report / "curves.json").read_text())
    curve = data["results"]["own"]["curve"]
    assert [row["step"] for row in curve] == [10, 20]  # every check of the 20 steps
    assert set(curve[0]["dev"]) == {"add2", "add3"} and set(curve[0]["held_out"]) == {"add2", "add3"}
    assert sorted(int(k) for k in data["stops"]["own"]) == list(RULES)
    assert (report / "warm_start_curves.png").stat().st_size > 10_000
    assert "| own | stop_when_checks 2 | 20 (never reached) |" in (report / "REPORT.md").read_text()
    assert not list(out.glob("*/checkpoints"))  # the checkpoints are removed once measured
    with_bad = subprocess.run([sys.executable, "-m", "demo.warm_start_curves", "--kernels", "own,avx1024", "--out-dir", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert with_bad.returncode == 2 and "unknown kernel choice(s) ['avx1024']" in with_bad.stderr
