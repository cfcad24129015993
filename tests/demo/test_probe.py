"""demo.probe on the toy world: the grafted rows' gradient under each correction, built by graft-train's own functions
from a real store on loopback, and the effective weights it reports checked by hand."""

from __future__ import annotations

import math

import pytest

from graft.services.store_api.http.testing import StoreServer
from train_configs import make_config
from toy.task import write_problems_jsonl

pytestmark = pytest.mark.slow


def test_the_probe_measures_each_correction_on_the_same_grafted_rows(toy_world, tmp_path):
    from demo.probe import SUPERVISED, probe

    problems = write_problems_jsonl(toy_world.peer_problems, tmp_path / "peer.jsonl")
    corrections = {
        "spec": ["graft.token_is=tis", "graft.kappa=1.0"],
        "b = 1": ["graft.token_is=none", "graft.kappa=1.0"],
        "b = 1, w = 1": ["graft.token_is=none", "graft.kappa=0.0"],
        "luffy": ["graft.token_is=luffy", "graft.kappa=0.0"],
    }
    with StoreServer(toy_world.store_root) as server:
        # skip_zero_advantage as the demo has it: rows of a grafted group left with one reward get no forward pass
        train = make_config(toy_world, tmp_path / "run", server.url, **{"data.dataset": str(problems),
                                                                      "rollout.group_size": 8,
                                                                      "optim.skip_zero_advantage": True})
        job = {"start": "toy", "train": train.model_dump(mode="json"), "rl_dataset": str(problems),
               "weak_dataset": toy_world.peer_problems[0].dataset, "eval_weak": str(problems),
               "probe": {"prompts": 8, "batch_prompts": 4, "gold_problems": 8, "corrections": corrections}}
        result = probe(job)

    assert 8 <= result["failed_prompts"] <= len(toy_world.peer_problems)  # the learner fails nearly every peer problem
    assert result["batches"] == 2 and result["probed_prompts"] == 8 and set(result["corrections"]) == {*corrections, SUPERVISED}
    for name, entry in result["corrections"].items():
        assert len(entry["batches"]) == 2 and all(-1.0 <= b["cos"] <= 1.0 for b in entry["batches"])
        assert entry["grad_norm_mean"] > 0, name
        assert ("cos_minus_spec" in entry) == (name not in ("spec", SUPERVISED))
    # |d loss / d log pi| per unit of advantage at the decisive token: c under the PPO ratio at r = 1 ...
    ones = [w for b in result["corrections"]["b = 1, w = 1"]["batches"] for w in b["decisive_weights"]]
    assert ones and all(w == pytest.approx(1.0, rel=1e-4) for w in ones)
    with_w = [w for b in result["corrections"]["b = 1"]["batches"] for w in b["decisive_weights"]]
    assert len(with_w) == len(ones) and all(0 < w <= 1.0 + 1e-6 for w in with_w) and min(with_w) < 0.99  # c = w
    spec = [w for b in result["corrections"]["spec"]["batches"] for w in b["decisive_weights"]]
    assert all(0 < s <= 2.0 * w + 1e-6 for s, w in zip(spec, with_w))  # c = w b, b <= 2
    # ... and p gamma / (p + gamma)^2 under LUFFY's shaping, which is at most 1 / (4 gamma)
    luffy = [w for b in result["corrections"]["luffy"]["batches"] for w in b["decisive_weights"]]
    assert luffy and all(0 < w <= 1 / (4 * 0.1) + 1e-6 for w in luffy)
    assert not math.isclose(sum(luffy), sum(ones))
