"""`python -m demo.run --quick`: the whole pipeline end to end, small. Asserts structure, not accuracy:
every stage ran through the real store, generator and trainer, the report has every key and file,
and the store server was stopped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_KEYS = {"mode", "seed", "acc_by_family", "acc_mean", "frac_all_fail_mean", "peer_hit_rate_mean", "frac_grafted_mean",
            "rollouts_generated", "peer_rollouts_consumed"}


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    out, report = tmp_path / "demo_out", tmp_path / "report"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    # The study's config (the demo's runs, its method variant included, and every ablation), shrunk by --quick
    args = ["--quick", "--config", str(REPO / "configs" / "demo_study.yaml"), "--out-dir", str(out), "--report-dir", str(report)]
    proc = subprocess.run([sys.executable, "-m", "demo.run", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((report / "summary.json").read_text())
    assert {"runs", "graft_minus_grpo_weak_family", "graft_minus_grpo_weak_family_std", "wall_time_s"} <= set(summary)
    modes = {r["mode"] for r in summary["runs"]}
    assert {"grpo", "graft", "graft_cotrain", "graft_no_peer_neg", "graft_no_seq_weight", "graft_no_token_is", "graft_fix",
            "graft_fix_with_b", "graft_fix_with_neg", "graft_fix_x1"} <= modes
    assert summary["variants_minus_grpo_weak_family"]["graft_fix"]["paired_seeds"] == 1
    assert set(summary["variants_target"]["graft_fix"]) == set(summary["target"])
    for run in summary["runs"]:
        assert RUN_KEYS <= set(run), run.keys()
        assert set(run["acc_by_family"]) == {"add2", "add3"}
        assert all(0.0 <= a <= 1.0 for a in run["acc_by_family"].values())
        assert run["rollouts_generated"] == summary["config"]["rl"]["steps"] * summary["config"]["rl"]["prompts_per_step"] * 8
    # The same rollout budget for every run; only GRAFT runs consume peer rollouts (GRPO never asks the store).
    assert all(r["peer_rollouts_consumed"] == 0 for r in summary["runs"] if r["mode"] == "grpo")
    assert all(r["peer_hit_rate_mean"] is None for r in summary["runs"] if r["mode"] == "grpo")
    cotrain = [r for r in summary["runs"] if r["mode"] == "graft_cotrain"]
    assert cotrain and all("cotrain_peer" in r and r["cotrain_peer"]["rollouts_generated"] > 0 for r in cotrain)
    # The peer's groups went through graft-generate into the store, and the co-trainers published theirs.
    assert summary["peer_groups"]["indexed_groups"] == sum(summary["config"]["task"]["rl_prompts"].values())
    store_models = {m["model_id"] for m in summary["store_stats"]["models"]}
    assert "toy-peer-qwen2" in store_models and any("-co" in m for m in store_models)
    assert summary["models"]["learner"]["architecture"] == "LlamaForCausalLM"
    # The ceiling run read the peer's correct answers back through the store's REST API.
    (ceiling,) = summary["peer_imitation"]
    assert ceiling["steps"] == (3 if ceiling["peer_correct_answers"] else 0) and set(ceiling["acc_greedy"]) == {"add2", "add3"}
    assert summary["models"]["peer"]["architecture"] == "Qwen2ForCausalLM"

    text = (report / "REPORT.md").read_text()
    assert "| run | seeds |" in text and "GRAFT co-training" in text and "peer negatives x0" in text and "The ceiling" in text
    assert "(not the spec's defaults: `graft.token_is=luffy graft.kappa=0 graft.peer_negative_scale=0 graft.peer_loss_scale=4`)" in text
    assert "The same target with this method" in text
    assert "GRAFT changed, peer rows x1 minus GRPO" in text and "minus GRAFT changed: LUFFY shaping" in text
    for png in ("accuracy_vs_step.png", "all_fail_vs_step.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| run | seeds |" in proc.stdout and "curl -s" in proc.stdout and "serve --root" in proc.stdout

    # The server is stopped: it said so, and nothing listens on its port any more.
    assert summary["server_stopped"] is True
    port = int(proc.stdout.split("store API up at http://127.0.0.1:")[1].split()[0])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0

    # A rerun finds every stage finished and only rewrites the report.
    again = subprocess.run([sys.executable, "-m", "demo.run", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads((report / "summary.json").read_text())
    assert rerun["runs"] == summary["runs"]
    # ... and still reports every job's wall time, as measured when it ran
    assert rerun["job_wall_s"] == summary["job_wall_s"] and set(summary["job_wall_s"]) >= {r["name"] for r in summary["runs"]}
