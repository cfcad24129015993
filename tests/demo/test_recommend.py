"""demo.recommend: the rule that chooses the demo's recommended GRAFT, and the configs it reads and writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from demo.config import load_demo_config
from demo.recommend import CANDIDATE_OVERRIDES, CANDIDATES, CHOOSE_SEEDS, HEADLINE_SEEDS, choose, headline, headline_config, main

REPO = Path(__file__).resolve().parents[2]


def _summary(accuracy: dict[str, tuple[float, float]], seeds: list[int]) -> dict:
    """A summary.json's runs: every mode at (weak, strong) accuracy on every seed, seed s adding s/1000 to both."""
    runs = [{"mode": mode, "seed": s, "acc_by_family": {"add3": weak + s / 1000, "add2": strong + s / 1000}}
            for mode, (weak, strong) in accuracy.items() for s in seeds]
    return {"weak_family": "add3", "strong_family": "add2", "runs": runs}


def test_the_choose_config_runs_exactly_the_candidates():
    cfg = load_demo_config(REPO / "configs" / "demo_choose.yaml", [], use_quick=False)
    ran = {"graft": []} | dict(cfg.rl.variants) | dict(cfg.rl.ablations)
    assert ran == CANDIDATE_OVERRIDES and set(CANDIDATES) == set(CANDIDATE_OVERRIDES)
    assert cfg.rl.seeds == CHOOSE_SEEDS == cfg.rl.ablation_seeds and not cfg.rl.cotrain


def test_the_rule_keeps_the_strong_family_then_takes_the_largest_weak_gain():
    summary = _summary({"grpo": (0.10, 0.95), "graft": (0.15, 0.96), "graft_no_peer_neg": (0.20, 0.94),
                        "graft_no_token_is": (0.40, 0.93), "graft_fix": (0.60, 0.90)}, CHOOSE_SEEDS)
    result = choose(summary)
    # graft_fix gains most on add3 but loses 5 points of add2; b = 1 loses 2 and is kept
    assert not result["candidates"]["graft_fix"]["strong_kept"] and result["candidates"]["graft_no_token_is"]["strong_kept"]
    assert result["chosen"] == "graft_no_token_is"
    assert result["candidates"]["graft_no_token_is"]["weak_gain"]["mean"] == pytest.approx(0.30)
    tie = _summary({"grpo": (0.10, 0.95), "graft": (0.30, 0.95), "graft_no_peer_neg": (0.30, 0.95),
                    "graft_no_token_is": (0.20, 0.95), "graft_fix": (0.0, 0.95)}, CHOOSE_SEEDS)
    assert choose(tie)["chosen"] == "graft"  # a tie goes to the fewer changes from the spec
    with pytest.raises(SystemExit, match="share only 3"):
        choose(_summary({m: (0.1, 0.9) for m in ["grpo", *CANDIDATES]}, [0, 1, 2]))


def test_the_headline_comes_from_seeds_the_choice_never_saw(tmp_path):
    seeds = CHOOSE_SEEDS + HEADLINE_SEEDS
    choosing = _summary({"grpo": (0.1, 0.95), **{m: (0.1, 0.95) for m in CANDIDATES}, "graft_no_token_is": (0.3, 0.95)}, seeds)
    # on the headline seeds the chosen variant's gain is what those runs say, not what the choice saw
    later = {"weak_family": "add3", "strong_family": "add2",
             "runs": [r for r in _summary({"grpo": (0.1, 0.95), "graft_no_token_is": (0.2, 0.96)}, HEADLINE_SEEDS)["runs"]]}
    assert headline(later, "graft_no_token_is")["weak_gain"]["mean"] == pytest.approx(0.1)
    (tmp_path / "choose.json").write_text(json.dumps(choosing))
    (tmp_path / "headline.json").write_text(json.dumps(later))
    config = tmp_path / "headline.yaml"
    assert main([str(tmp_path / "choose.json"), "--write-headline-config", str(config), "--headline", str(tmp_path / "headline.json")]) == 0
    result = json.loads((tmp_path / "recommendation.json").read_text())
    assert result["chosen"] == "graft_no_token_is" and result["headline"]["weak_gain"]["seeds"] == 3
    cfg = load_demo_config(config, [], use_quick=False)
    assert cfg.rl.seeds == HEADLINE_SEEDS and cfg.rl.ablations == {"graft_no_token_is": ["graft.token_is=none"]} and not cfg.rl.variants
    for chosen in CANDIDATES:  # every possible choice gives a config the demo accepts
        load_demo_config(None, [f"{k}={json.dumps(v)}" for k, v in headline_config(chosen).items()], use_quick=False)
    assert yaml.safe_load(config.read_text())["report_dir"] == "report/headline"
