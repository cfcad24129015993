"""The loop of issue 50 closing, end to end on the toy models and a real store over loopback: a learner whose failed
prompts have no peer group at the start posts them as wanted (store.want_misses); a generator in continuous mode
following wanted prompts (graft-generate with follow_wanted: the toy peer, a dataset of other problems) samples them;
the learner's peer hit rate rises from 0 when it meets those prompts again, and the store's metrics give the time from
a want to its group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from train_configs import make_config

from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer
from graft.trainer.loop import train
from toy.task import sample_problems, write_problems_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def read_lines(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_a_learners_misses_become_a_generators_work_and_its_hit_rate_rises(toy_world, tmp_path):
    other_problems = write_problems_jsonl(sample_problems(8, seed=99), tmp_path / "other.jsonl")
    log = tmp_path / "generator.log"
    with StoreServer(tmp_path / "store") as server, StoreClient(server.url) as client:
        # an epoch of the 32 problems (4 steps of 8) on an empty store: every all-fail prompt misses, and is wanted
        cfg = make_config(toy_world, tmp_path / "run", server.url, steps=4, **{"store.want_misses": True})
        train(cfg)
        first = read_lines(tmp_path / "run" / "metrics.jsonl")
        assert all(m["peer_hit_rate"] == 0 for m in first if m["frac_all_fail"] > 0)
        wanted = {p.prompt_id for p in client.wanted(model="toy-peer", limit=1024).prompts}
        assert wanted and sum(m["store_wants_posted"] for m in first) >= len(wanted)
        assert sum(m["store_broker_failures"] for m in first) == 0
        assert client.stats().broker.wants_recorded == len(wanted)

        generator = subprocess.Popen(
            [sys.executable, "-m", "graft.services.generator.cli", "--model", str(toy_world.peer_dir), "--model-id",
             "toy-peer", "--dataset", str(other_problems), "--store", server.url, "--set", "prompt.template=raw", "--set", "group_size=8",
             "--set", "max_tokens=16", "--set", "scoring.workers=1", "--set", "progress=false",
             "--set", "prompts_per_batch=16", "--set", "seed=0", "--set", "continuous=true", "--set", "follow_wanted=true"],
            cwd=REPO_ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            # until each wanted prompt is served (an informative group of the peer cleared it) or was sampled twice
            # (the peer solves its own family's problems in part, the learner's hardly: those wants stay open)
            def settled() -> bool:
                still = {p.prompt_id for p in client.wanted(model="toy-peer", limit=1024).prompts}
                return all(len(client.prompt_groups(p, model="toy-peer")) >= 2 for p in still)

            deadline = time.monotonic() + 300
            while not settled():
                assert generator.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1.0)
            broker = client.stats().broker
            assert broker.wants_cleared > 0 and broker.backlog_prompts == len(wanted) - broker.wants_cleared
            assert broker.want_to_group_s_p50 is not None and broker.want_to_group_s_p50 > 0
            served = wanted - {p.prompt_id for p in client.wanted(model="toy-peer", limit=1024).prompts}
            assert all(any(g.informative for g in client.prompt_groups(p, model="toy-peer")) for p in served)

            # the next epoch meets the same prompts again: its lookups find the generator's groups
            train(cfg.model_copy(update={"steps": 8}), resume=True)
            second = read_lines(tmp_path / "run" / "metrics.jsonl")[4:]
        finally:
            generator.send_signal(signal.SIGTERM)
            generator.wait(timeout=120)
    assert [m["step"] for m in second] == [5, 6, 7, 8]
    hits = sum(m["peer_hit_rate"] * m["frac_all_fail"] for m in second if m["frac_all_fail"] > 0)
    assert hits > 0 and sum(m["frac_grafted"] > 0 for m in second) >= 2, second
    print({"wanted": len(wanted), "served": len(served), "want_to_group_s_p50": broker.want_to_group_s_p50,
           "peer_hit_rate": [m["peer_hit_rate"] for m in second]})


def test_a_cap_on_serving_keeps_the_learner_from_grafting_a_group_twice(toy_world, tmp_path):
    """store.max_times_served 1 on the toy world's store (one peer group per prompt): the trainer posts each step's
    grafts to the served ledger, and the second epoch over the same prompts finds the groups it grafted served out."""
    import shutil

    shutil.copytree(toy_world.store_root, tmp_path / "store")
    with StoreServer(tmp_path / "store") as server, StoreClient(server.url) as client:
        cfg = make_config(toy_world, tmp_path / "run", server.url, steps=8,
                          **{"store.max_times_served": 1, "store.groups_per_prompt": 1})
        train(cfg)
        records = read_lines(tmp_path / "run" / "peer_groups.jsonl")
        metrics = read_lines(tmp_path / "run" / "metrics.jsonl")
        grafted = [g for r in records for g in r["grafted"]]
        assert grafted and len(grafted) == len(set(grafted))  # no group grafted twice
        assert sum(m["store_served_posted"] for m in metrics) == len(grafted)
        assert client.stats().broker.ledger_entries == len(grafted)
        learner = toy_world.learner_dir.name  # the learner's model id: its directory's name
        assert {g: client.times_served(g) for g in grafted} == {g: {learner: 1} for g in grafted}
        # the second epoch meets the prompts it grafted in the first: served out now
        served_out = sum(m["groups_no_peer_served_out"] for m in metrics[4:])
        assert served_out > 0 and all(m["groups_no_peer_served_out"] == 0 for m in metrics[:4])
        assert any("served_out" in r["miss_reasons"].values() for r in records[4:])
