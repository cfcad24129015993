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
RUN_KEYS = {"mode", "start", "seed", "primary", "greedy_late", "evals", "frac_all_fail_mean", "peer_hit_rate_mean",
            "frac_grafted_mean", "groups_capped_per_step", "grafted_groups_short_per_step", "rollouts_generated",
            "peer_rollouts_consumed"}


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    out, report = tmp_path / "demo_out", tmp_path / "report"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    # The study's config (the demo's runs, every variant and the co-training pairs), shrunk by --quick
    args = ["--quick", "--config", str(REPO / "studies" / "configs" / "study.yaml"), "--out-dir", str(out), "--report-dir", str(report)]
    proc = subprocess.run([sys.executable, "-m", "demo.run", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((report / "summary.json").read_text())
    assert {"runs", "comparisons", "rule", "primary_metric", "starts", "probes", "machine"} <= set(summary)
    # what ran (issue 60): the invocation's commit, tree, host and time, and every run's own
    record = summary["record"]
    assert record["commit"] and record["clean"] in (True, False) and record["host"]["cpu"] and record["started"]
    assert record["jobs_ran"] > 0 and record["rule"] == summary["rule_version"]
    assert all(r["record"]["commit"] and r["record"]["cpu"] and r["record"]["finished"] for r in summary["runs"])
    local = json.loads((report / "local.json").read_text())  # the times, beside the committed files (issue 51)
    assert "wall_time_s" not in summary and local["wall_time_s"] > 0
    assert all(run["stage_s"]["sampling and scoring"] > 0 and run["stage_s"]["evaluation"] > 0 for run in local["runs"])
    config = summary["config"]
    starts, seeds = list(config["starts"]), config["rl"]["seeds"]
    assert set(summary["starts"]) == set(starts) == {"early", "late"} and set(summary["probes"]) == set(starts)
    ran = {r["mode"] for r in summary["runs"]}
    assert {"grpo", "graft_cotrain", "graft_fix", "graft_no_seq_weight"} <= ran
    # every method against GRPO: paired over (start, seed), with its verdict; a method whose runs are another's, named so
    for mode in config["rl"]["methods"]:
        comparison = summary["comparisons"][mode]
        if "same_as" in comparison:
            assert comparison["same_as"] in config["rl"]["methods"] and mode not in ran
            continue
        assert comparison["weak"]["pairs"] == len(starts) * len(seeds)
        assert comparison["verdict"] in ("gain", "small gain", "no gain", "loss", "harm", "undecided")
        assert set(comparison["per_start"]) == set(starts)
    assert summary["comparisons"]["graft_cotrain"]["weak"]["pairs"] == len(starts) * len(config["rl"]["cotrain_seeds"])
    for run in summary["runs"]:
        assert RUN_KEYS <= set(run), run.keys()
        assert run["start"] in starts and set(run["primary"]) == {"add2", "add3"}
        assert all(0.0 <= a <= 1.0 for a in run["primary"].values())
        assert run["rollouts_generated"] == config["rl"]["steps"] * config["rl"]["prompts_per_step"] * 8
        assert [e["step"] for e in run["evals"]] == [2, 4] and all("acc_sampled" in e for e in run["evals"])
    # The same rollout budget for every run; only GRAFT runs consume peer rollouts (GRPO never asks the store).
    assert all(r["peer_rollouts_consumed"] == 0 and r["peer_hit_rate_mean"] is None for r in summary["runs"] if r["mode"] == "grpo")
    cotrain = [r for r in summary["runs"] if r["mode"] == "graft_cotrain"]
    assert cotrain and all("cotrain_peer" in r and r["cotrain_peer"]["rollouts_generated"] > 0 for r in cotrain)
    # The peer's groups went through graft-generate into the store, and the co-trainers published theirs.
    assert summary["peer_groups"]["indexed_groups"] == sum(config["task"]["rl_prompts"].values())
    store_models = {m["model_id"] for m in summary["store_stats"]["models"]}
    assert "toy-peer-qwen2" in store_models and any("-co" in m for m in store_models)
    assert summary["models"]["learner"]["architecture"] == "LlamaForCausalLM"
    assert summary["models"]["peer"]["architecture"] == "Qwen2ForCausalLM"
    # The ceiling runs read the peer's correct answers back through the store's REST API, one per start.
    assert {c["start"] for c in summary["peer_imitation"]} == set(starts)
    assert all(set(c["acc_sampled"]) == {"add2", "add3"} for c in summary["peer_imitation"])

    text = (report / "REPORT.md").read_text()
    assert "| method vs GRPO, paired by (start, seed) |" in text and "## The starts (chosen by level, not by step)" in text
    assert "groups over the graft cap, per step" in text and "Co-training, the peer's side" in text
    assert ("## The mechanism probe" in text) or ("had nothing to probe" in text)
    assert (report / "accuracy_vs_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Each GRAFT against GRPO" in proc.stdout and "curl -s" in proc.stdout and "serve --root" in proc.stdout
    assert "RL runs' time by stage (s, share): sampling and scoring" in proc.stdout

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
    rerun_local = json.loads((report / "local.json").read_text())
    assert rerun_local["job_wall_s"] == local["job_wall_s"]
    assert set(local["job_wall_s"]) >= {r["name"] for r in summary["runs"]}
    assert "Wall time of this invocation" in again.stdout
