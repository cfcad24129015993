"""`python -m demo.mutual --quick`: the mutual demo's whole pipeline, small (structure, not accuracy): both warm starts,
both models' stored groups through graft-generate and the store, every run of both models under the same budget, and a
report with the table, the verdict and the plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from demo.config import load_demo_config
from demo.mutual import DEFAULT_CONFIG, check_config

REPO = Path(__file__).resolve().parents[2]
MODES = {"grpo", "cotrain_graft", "cotrain_graft_b1", "cotrain_graft_fix", "offline"}


@pytest.mark.slow
def test_quick_mutual_demo_end_to_end(tmp_path):
    out, report = tmp_path / "out", tmp_path / "report"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "demo.mutual", "--quick", "--out-dir", str(out), "--report-dir", str(report)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((report / "summary.json").read_text())
    rl, task = summary["config"]["rl"], summary["config"]["task"]
    assert summary["families"] == ["add2", "add3", "add3r"]
    assert summary["strong_family"] == {"A": "add3", "B": "add3r"}
    assert summary["start"]["A"]["architecture"] == "LlamaForCausalLM" and summary["start"]["B"]["architecture"] == "Qwen2ForCausalLM"
    assert summary["start"]["A"]["vocab_size"] != summary["start"]["B"]["vocab_size"]  # two tokenizers
    # Each warm start's groups went into the store once, through graft-generate, one per RL prompt.
    for name in ("A", "B"):
        assert summary["stored_groups"][name]["indexed_groups"] == sum(task["rl_prompts"].values())
    # Every run of both models, one per seed, and the same rollout budget in each.
    budget = rl["steps"] * rl["prompts_per_step"] * rl["group_size"]
    for name in ("A", "B"):
        runs = [r for r in summary["runs"] if r["model"] == name]
        assert {r["mode"] for r in runs} == MODES
        assert sorted(r["seed"] for r in runs if r["mode"] == "offline") == rl["seeds"]
        assert all(r["rollouts_generated"] == budget and r["steps"] == rl["steps"] for r in runs), [r["rollouts_generated"] for r in runs]
        assert all(r["peer_rollouts_consumed"] == 0 for r in runs if r["mode"] == "grpo")
        assert all(r["acc_by_step"][-1]["step"] == rl["steps"] for r in runs)
        per_mode = summary["per_model"][name]
        assert set(per_mode) == MODES and "gain" not in per_mode["grpo"]
        assert all(set(per_mode[m]["gain"]) == {"mean", "add2", "add3", "add3r"} for m in MODES - {"grpo"})
    verdict = summary["verdict"]
    assert set(verdict["cotrain"]) == {"cotrain_graft", "cotrain_graft_b1", "cotrain_graft_fix"}
    for entry in verdict["cotrain"].values():
        assert set(entry["gain_mean"]) == {"A", "B"} and isinstance(entry["holds"], bool)
    assert set(verdict["offline_keeps_most"]) == {"A", "B"} and "chosen" in verdict["recommendation"]

    text = (report / "REPORT.md").read_text()
    assert text.count("| model | run |") == 2 and "## Verdict" in text and "Recommendation" in text
    for plot in ("accuracy_vs_step.png", "gain_over_grpo.png"):
        assert (report / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| A | GRPO alone |" in proc.stdout and "| B | co-training, GRAFT (spec defaults) |" in proc.stdout


def test_mutual_demo_refuses_what_it_would_ignore_or_cannot_compare():
    with pytest.raises(SystemExit, match="no 'graft'"):
        check_config(load_demo_config(DEFAULT_CONFIG, ["rl.variants={graft_b1: [graft.token_is=none]}"], use_quick=False))
    with pytest.raises(SystemExit, match="rl.ablations"):
        check_config(load_demo_config(DEFAULT_CONFIG, ["rl.ablations={x: [graft.kappa=0]}"], use_quick=False))
    check_config(load_demo_config(DEFAULT_CONFIG, [], use_quick=True))
