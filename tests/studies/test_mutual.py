"""`python -m studies.mutual --quick` (and its budget pilot): the mutual study's whole pipeline, small (structure, not
accuracy): both pairs' warm starts at two starts by level, each start's stored groups through graft-generate and the
store, every arm of both models, the ceilings and the controls, and a report with the answers MUTUAL_RULE gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from demo.config import load_demo_config
from demo.stats import Interval
from studies.mutual import PAIRS, check_config
from studies.mutual_report import CEILING_SHARE, MODE_LABEL, bar, claim

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out, report = tmp_path / "out", tmp_path / "report"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "studies.mutual", "--quick", "--out-dir", str(out), "--report-dir",
                           str(report), *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    return proc, report


@pytest.mark.slow
def test_quick_mutual_study_end_to_end(tmp_path):
    pilot, report = _run(tmp_path, "--pilot", "--pairs", "digit_order")
    assert pilot.returncode == 0, pilot.stdout[-3000:] + pilot.stderr[-3000:]
    result = json.loads((report / "digit_order" / "pilot" / "summary.json").read_text())
    assert result["pairs"]["digit_order"]["chosen_lr"] in (1e-4, 3e-4, 1e-3) and result["record"]["commit"]
    assert (report / "digit_order" / "pilot" / "pilot.png").read_bytes()[:4] == b"\x89PNG"
    proc, report = _run(tmp_path, "--pairs", "digit_order")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((report / "digit_order" / "summary.json").read_text())
    pair = summary["pairs"]["digit_order"]
    assert summary["record"]["jobs_ran"] > 0 and summary["record"]["host"]["cpu"]
    assert {r["mode"] for r in pair["runs"]} == set(MODE_LABEL)
    for model in ("A", "B"):
        runs = [r for r in pair["runs"] if r["model"] == model]
        assert {r["start"] for r in runs} == {"early", "late"}
        assert all(r["record"]["commit"] and r["record"]["cpu"] for r in runs)  # every run's record
        answer = pair["answers"][model]
        assert answer["cotrain_vs_offline"]["answer"] in ("yes", "no", "undecided")
        assert {b for arm in ("cotrain", "offline") for b in answer["bars"][arm].values() if isinstance(b, str)} <= {
            "reached", "short", "undecided"}
        assert answer["peer_change"]["pairs"] == 2  # a co-training run per start
    # the offline run grafted rows, which the matched GRPO run trained on at their step
    matched = [r for r in pair["runs"] if r["mode"] == "grpo_matched"]
    assert matched and all(r["steps"] for r in matched)
    text = (report / "digit_order" / "REPORT.md").read_text()
    assert "co-training beats offline?" in text and "**Record**" in text and "the paper's claim" in text
    assert (report / "digit_order" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    index = (report / "REPORT.md").read_text()  # every pair's answers, each pair's report linked
    assert "co-training beats offline?" in index and "[digit_order/REPORT.md](digit_order/REPORT.md)" in index
    # co-training in lockstep (issue 50): the same command, in a fresh folder, gives the same co-training rows to the
    # last digit (every metric the report reads, every evaluation)
    again, report_again = _run(tmp_path / "again", "--pairs", "digit_order")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rerun = json.loads((report_again / "digit_order" / "summary.json").read_text())["pairs"]["digit_order"]

    def cotrain_rows(p: dict) -> list[dict]:
        rows = sorted((r for r in p["runs"] if r["mode"] == "cotrain"), key=lambda r: (r["name"], r["model"]))
        return [{k: v for k, v in r.items() if k != "record"} for r in rows]

    assert cotrain_rows(pair) and cotrain_rows(rerun) == cotrain_rows(pair)


def test_the_pair_configs_are_the_designs():
    for name, path in PAIRS.items():
        cfg = load_demo_config(path, [], use_quick=False)
        check_config(cfg, pilot=False)
        assert set(cfg.starts) == set(cfg.peer_starts) == {"early", "late"} and len(cfg.rl.seeds) * 2 >= 6
        assert cfg.learner.level_family == cfg.task.weak_family and cfg.peer.level_family == cfg.task.strong_family


@pytest.mark.parametrize("weak, d, expected", [
    ((0.05, 0.02, 0.08, 0.01), None, "reached"),
    ((0.01, 0.005, 0.015, 0.01), None, "short"),  # shown, but below +2 points
    ((0.03, -0.01, 0.07, 0.2), None, "undecided"),
    ((0.05, 0.02, 0.08, 0.01), (0.01, -0.01, 0.03, 0.3), "reached"),  # gain shown, d's mean at least 0
    ((0.05, 0.02, 0.08, 0.01), (-0.05, -0.08, -0.02, 0.01), "short"),  # d shown below 0
    ((0.05, 0.02, 0.08, 0.01), (-0.01, -0.04, 0.02, 0.4), "undecided"),
])
def test_the_bars(weak, d, expected):
    assert bar(Interval(*weak, pairs=8), None if d is None else Interval(*d, pairs=8)) == expected
    assert CEILING_SHARE == 0.25


def test_the_claim_needs_both_models_and_offline_keeping_half():
    def model(cotrain_bar: str, cotrain: float, offline: float) -> dict:
        return {"bars": {"cotrain": {"two_points": cotrain_bar}}, "vs_grpo": {"cotrain": {"weak": {"mean": cotrain}},
                                                                             "offline": {"weak": {"mean": offline}}}}

    assert claim({"A": model("reached", 0.05, 0.04), "B": model("reached", 0.04, 0.03)}) == "holds"
    assert claim({"A": model("reached", 0.05, 0.01), "B": model("reached", 0.04, 0.03)}) == "does not hold"
    assert claim({"A": model("short", 0.0, 0.0), "B": model("reached", 0.04, 0.03)}) == "does not hold"
    assert claim({"A": model("undecided", 0.03, 0.03), "B": model("reached", 0.04, 0.03)}) == "undecided"


def test_docs_state_the_mutual_rules_as_the_code_has_them():
    """docs/demo.md's design quotes PILOT_RULE and MUTUAL_RULE word for word (line breaks aside): a change to either
    shows in the page, with its commit, before a run reads it."""
    from studies.mutual_report import MUTUAL_RULE, PILOT_RULE

    page = (REPO / "docs" / "demo.md").read_text()
    section = page.split("### The design (issue 60), written before its runs", 1)[1].split("\n### ", 1)[0]
    section = " ".join(section.replace("\n> ", " ").split())
    assert " ".join(PILOT_RULE.split()) in section and " ".join(MUTUAL_RULE.split()) in section
