"""Lockstep co-training and replay (issues 50, 58), end to end on the toy models and a real store over loopback.

- Two graft-train processes co-training in lockstep, twice, each time on a fresh store: the same metrics (but the
  times and the store call counts) and the same recorded peer groups. A partner that stops: the error names it.
- Lockstep by liveness: a partner busy far longer than peers.partner_timeout_s (an evaluation, a checkpoint) is
  waited for; a partner killed with SIGKILL stops the run within the timeout.
- An offline GRAFT run, then its replay (peers.source replay): the same metrics and record. A group changed in the
  store, a group gone, another config: each refused, named. A replay whose sampler draws otherwise (the model at the
  run's path changed) stops at the first step, naming it and what differed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import yaml
from train_configs import make_config

from graft.schemas import table_to_groups
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local.manifest import live_files
from graft.services.store_api.local.shards import write_groups
from graft.trainer.loop import train
from graft.trainer.peers import PartnerGone
from graft.trainer.replay import ReplayMismatch

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def read_lines(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def reproducible(metrics):
    """A metrics line without what depends on timing: the times (*_s) and the store call counts (store_*: a wait polls
    as often as it takes, a background push lands before or after the line)."""
    return {k: v for k, v in metrics.items() if not (k.endswith("_s") or k.startswith("store_"))}


def same_lines(a, b):
    # orjson writes NaN as null: two lines compare equal, NaNs included
    return orjson.dumps([reproducible(m) for m in a]) == orjson.dumps([reproducible(m) for m in b])


def ids(records):
    return [({p: [g["group_id"] for g in groups] for p, groups in r["groups"].items()}, r["grafted"]) for r in records]


def cotrain_args(world, store_url, steps=3, timeout_s=300):
    common = ["--store-url", store_url, "--peers", "lockstep", "--steps", str(steps), "--dataset", str(world.problems_path),
              "--group-size", "4", "--prompts-per-step", "8", "--seed", "0",
              "--set", "prompt.template=raw", "--set", "rollout.max_response_tokens=16",
              "--set", "rollout.backend=hf", "--set", "rollout.scorer_workers=1", "--set", "optim.mini_batch_prompts=8",
              "--set", f"peers.partner_timeout_s={timeout_s}",
              "--set", "logging.progress=false", "--set", "model.device=cpu", "--set", "torch_threads=1"]
    return {
        "learner": [*common, "--model", str(world.learner_dir), "--peer-models", "peer",
                    "--set", f"graft.peer_tokenizers=[{world.peer_dir}]"],
        "peer": [*common, "--model", str(world.peer_dir), "--peer-models", "learner",
                 "--set", f"graft.peer_tokenizers=[{world.learner_dir}]"],
    }


def cotrain_pair(world, root):
    """Learner and peer co-training in lockstep through a fresh store under `root`; their run dirs."""
    with StoreServer(root / "store") as server:
        runs = cotrain_args(world, server.url)
        procs = {name: subprocess.Popen([sys.executable, "-m", "graft.trainer.cli", "train", *args,
                                         "--run-dir", str(root / name)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for name, args in runs.items()}
        outputs = {name: p.communicate(timeout=600)[0].decode(errors="replace") for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} failed:\n{outputs[name][-3000:]}"
    return {name: root / name for name in runs}


def test_lockstep_cotraining_gives_the_same_metrics_twice(toy_world, tmp_path):
    first, second = cotrain_pair(toy_world, tmp_path / "first"), cotrain_pair(toy_world, tmp_path / "second")
    for name in ("learner", "peer"):
        a, b = read_lines(first[name] / "metrics.jsonl"), read_lines(second[name] / "metrics.jsonl")
        assert [m["step"] for m in a] == [1, 2, 3]
        assert same_lines(a, b), name
        assert all(m["cotrain_peer_silent_steps"] == 0 for m in a)
        # each step's candidates: the partner's group of that very step for every prompt, the same ids both times (not
        # the same hashes: a group's rows carry the time it was sampled)
        records = read_lines(first[name] / "peer_groups.jsonl")
        assert ids(records) == ids(read_lines(second[name] / "peer_groups.jsonl"))
        assert all(r["groups"] and all(len(groups) == 1 for groups in r["groups"].values()) for r in records)
    learner = read_lines(first["learner"] / "metrics.jsonl")
    assert any(m["frac_grafted"] > 0 for m in learner)
    assert all(m["peer_group_age_steps"] == 0 for m in learner if m["frac_grafted"] > 0)

    # `graft-train replay` of the learner's run, on the store it ran against and without its partner: the same metrics
    from typer.testing import CliRunner

    from graft.trainer.cli import app

    with StoreServer(tmp_path / "first" / "store") as server:
        result = CliRunner().invoke(app, ["replay", str(first["learner"]), "--run-dir", str(tmp_path / "replay"),
                                          "--store-url", server.url])
    assert result.exit_code == 0, result.output
    assert same_lines(learner, read_lines(tmp_path / "replay" / "metrics.jsonl"))


def test_lockstep_stops_naming_the_partner_that_stopped(toy_world, tmp_path):
    """The peer trains one step and exits; its heartbeats stop with it: the learner's second step waits
    peers.partner_timeout_s, then fails naming it (not a step trained as GRPO)."""
    with StoreServer(tmp_path / "store") as server, StoreClient(server.url) as client:
        peer_args = cotrain_args(toy_world, server.url, steps=1)["peer"]
        peer = subprocess.Popen([sys.executable, "-m", "graft.trainer.cli", "train", *peer_args, "--run-dir",
                                 str(tmp_path / "peer")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            # the peer's step is in the store (it now waits for the learner's): the learner's first wait is short
            while not any(m.model_id == "peer" and m.groups for m in client.stats().models):
                assert peer.poll() is None, peer.communicate()[0].decode(errors="replace")[-3000:]
                time.sleep(0.5)
            cfg = make_config(toy_world, tmp_path / "learner", server.url, steps=2, **{
                "peers.source": "lockstep", "peers.partner_timeout_s": 5.0, "graft.peer_models": ["peer"]})
            with pytest.raises(PartnerGone, match=r"peer is gone: .* it showed no sign of life \(its last heartbeat: step 0, "
                                                  r".*It owes groups of step 1 for \d+ of this step's \d+ prompts"):
                train(cfg)
        finally:
            assert peer.wait(timeout=600) == 0, peer.communicate()[0].decode(errors="replace")[-3000:]
    assert [m["step"] for m in read_lines(tmp_path / "learner" / "metrics.jsonl")] == [1]


def lockstep(world, partner, timeout_s, **overrides):
    """Lockstep overrides of make_config: its partner `partner` ("learner" or "peer": the toy world's model of that
    name, whose tokenizer is then the peer tokenizer)."""
    other = world.learner_dir if partner == "learner" else world.peer_dir
    return {"peers.source": "lockstep", "peers.partner_timeout_s": timeout_s, "graft.peer_models": [other.name],
            "graft.peer_tokenizers": [str(other)], **overrides}


def start_partner(world, root, store_url, pause_after, pause_s, timeout_s):
    """The toy peer in lockstep with the learner, in a process of its own (tests/trainer/helpers/lockstep_partner.py) that
    pauses `pause_s` after its step `pause_after`."""
    cfg = make_config(world, root / "peer", store_url, steps=3, **lockstep(world, "learner", timeout_s),
                      **{"model.path": str(world.peer_dir)})
    path = root / "peer.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    partner = subprocess.Popen([sys.executable, str(HERE / "helpers" / "lockstep_partner.py"), str(path), str(pause_after),
                                str(pause_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    # started (its first heartbeat is in): what follows is about a partner that lives, not one that starts up
    with StoreClient(store_url) as client:
        while not client.heartbeats([world.peer_dir.name]):
            assert partner.poll() is None, partner.communicate()[0].decode(errors="replace")[-3000:]
            time.sleep(0.2)
    return partner


def test_lockstep_waits_for_a_partner_busy_longer_than_its_timeout(toy_world, tmp_path):
    """The peer pauses 15 s after its first step (an evaluation, a checkpoint) while the learner's timeout is 4 s: its
    heartbeats go on from their own thread, so the learner waits it out and the pair trains every step. (A per-step
    budget of 4 s, the old store.cotrain_wait_s, stopped the learner here with PartnerGone.)"""
    with StoreServer(tmp_path / "store") as server:
        peer = start_partner(toy_world, tmp_path, server.url, pause_after=1, pause_s=15, timeout_s=4)
        try:
            train(make_config(toy_world, tmp_path / "learner", server.url, steps=3, **lockstep(toy_world, "peer", 4)))
        finally:
            output = peer.communicate(timeout=600)[0].decode(errors="replace")
        assert peer.returncode == 0, output[-3000:]
    learner = read_lines(tmp_path / "learner" / "metrics.jsonl")
    assert [m["step"] for m in learner] == [1, 2, 3]
    assert max(m["store_wait_s"] for m in learner) > 2 * 4  # it waited well past its timeout: the partner lived
    assert all(m["cotrain_peer_silent_steps"] == 0 for m in learner)


def test_lockstep_stops_within_its_timeout_when_the_partner_is_killed(toy_world, tmp_path):
    """The peer is killed (SIGKILL) once the learner's first step is done: no heartbeat, no group comes any more, and
    the learner's next wait stops with PartnerGone within peers.partner_timeout_s (and a few polls) of the kill."""
    killed = {}
    with StoreServer(tmp_path / "store") as server:
        peer = start_partner(toy_world, tmp_path, server.url, pause_after=1, pause_s=600, timeout_s=4)

        def kill_the_partner(metrics):
            if metrics["step"] == 1:
                peer.kill()
                killed["at"] = time.monotonic()

        try:
            with pytest.raises(PartnerGone, match=r"peer is gone: for peers.partner_timeout_s = 4 s it showed no sign of life"):
                train(make_config(toy_world, tmp_path / "learner", server.url, steps=3, **lockstep(toy_world, "peer", 4)),
                      on_step=kill_the_partner)
            stopped_after = time.monotonic() - killed["at"]
        finally:
            peer.kill()
            peer.communicate(timeout=60)
    assert 4 <= stopped_after < 4 + 10, stopped_after
    assert [m["step"] for m in read_lines(tmp_path / "learner" / "metrics.jsonl")] == [1]


def replaying(run_dir):
    return {"peers.source": "replay", "peers.run_dir": str(run_dir)}


def stored_groups(root):
    return [g for path in live_files(root) for g in table_to_groups(pq.read_table(root / path))]


def test_a_replay_equals_its_run_and_refuses_changed_or_missing_groups(toy_world, tmp_path):
    shutil.copytree(toy_world.store_root, tmp_path / "store")
    with StoreServer(tmp_path / "store") as server:
        run_dir = train(make_config(toy_world, tmp_path / "run", server.url, steps=2))
        replay_dir = train(make_config(toy_world, tmp_path / "replay", server.url, steps=2, **replaying(run_dir)))
        with pytest.raises(ReplayMismatch, match=r"optim\.lr: 0\.002 -> 0\.001"):
            train(make_config(toy_world, tmp_path / "other", server.url, steps=2, **replaying(run_dir), **{"optim.lr": 1e-3}))
        with pytest.raises(ReplayMismatch, match=r"steps: 2 -> 3"):  # fewer steps replay a prefix; more cannot
            train(make_config(toy_world, tmp_path / "longer", server.url, steps=3, **replaying(run_dir)))
    run, replayed = read_lines(run_dir / "metrics.jsonl"), read_lines(replay_dir / "metrics.jsonl")
    assert [m["step"] for m in replayed] == [1, 2] and any(m["frac_grafted"] > 0 for m in run)
    assert same_lines(run, replayed)
    assert read_lines(run_dir / "peer_groups.jsonl") == read_lines(replay_dir / "peer_groups.jsonl")
    assert all(m["store_lookups"] == 0 for m in replayed)  # no lookup: the groups came by id

    grafted = read_lines(run_dir / "peer_groups.jsonl")[0]["grafted"][0]
    groups = stored_groups(tmp_path / "store")
    changed = [g if g.group_id != grafted else g.model_copy(update={"rollouts": [
        r.model_copy(update={"generator_id": "edited"}) for r in g.rollouts]}) for g in groups]
    write_groups(tmp_path / "changed", changed)
    write_groups(tmp_path / "missing", [g for g in groups if g.group_id != grafted])
    for store, says in (("changed", "has changed in the store"), ("missing", "is gone from the store")):
        with StoreServer(tmp_path / store) as server, \
                pytest.raises(ReplayMismatch, match=f"step 1, prompt .*: peer group {grafted} .*{says}"):
            train(make_config(toy_world, tmp_path / f"replay-{store}", server.url, steps=2, **replaying(run_dir)))


def test_a_replay_that_parts_from_its_run_stops_at_the_first_step_naming_what_differed(toy_world, tmp_path):
    """The record holds a digest of the learner's own rewards of each prompt and the grafted ids: a replay whose sampler
    draws otherwise (here the model at the run's path changed, as another machine's kernels would change it) stops at
    step 1 naming the prompts whose rewards differ, before training it; one whose gate grafts otherwise (a record edited
    here) names both lists. Never a replay that runs on with other metrics."""
    import torch
    from safetensors.torch import load_file, save_file

    learner = Path(shutil.copytree(toy_world.learner_dir, tmp_path / "learner"))
    shutil.copytree(toy_world.store_root, tmp_path / "store")
    with StoreServer(tmp_path / "store") as server:
        run_dir = train(make_config(toy_world, tmp_path / "run", server.url, steps=2, **{"model.path": str(learner)}))
        record = read_lines(run_dir / "peer_groups.jsonl")
        assert all(len(line["rewards"]) == 8 for line in record) and record[0]["grafted"]

        edited = Path(shutil.copytree(run_dir, tmp_path / "edited"))
        record[0]["grafted"] = record[0]["grafted"][1:]
        (edited / "peer_groups.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in record))
        with pytest.raises(ReplayMismatch, match=r"step 1: the gate grafted \[.*\] where the recorded run .* grafted"):
            train(make_config(toy_world, tmp_path / "replay-edited", server.url, steps=2,
                              **{"model.path": str(learner)}, **replaying(edited)))

        weights = load_file(str(learner / "model.safetensors"))
        generator = torch.Generator().manual_seed(0)
        save_file({name: w + 0.5 * torch.randn(w.shape, generator=generator) for name, w in weights.items()},
                  str(learner / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ReplayMismatch, match=r"step 1: the learner's own rewards differ from the recorded run's .* "
                                                 r"its sampler drew other completions"):
            train(make_config(toy_world, tmp_path / "replay", server.url, steps=2, **{"model.path": str(learner)},
                              **replaying(run_dir)))
    assert not (tmp_path / "replay" / "metrics.jsonl").exists() or not read_lines(tmp_path / "replay" / "metrics.jsonl")


def test_graft_train_replay_names_what_is_missing(toy_world, tmp_path):
    """`graft-train replay RUN_DIR`: a run directory without a record is refused in a line, before any model loads."""
    import yaml
    from typer.testing import CliRunner

    from graft.trainer.cli import app

    (tmp_path / "run").mkdir()
    config = make_config(toy_world, tmp_path / "run", "http://127.0.0.1:1").model_dump(mode="json")
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "run"), "--run-dir", str(tmp_path / "again")])
    assert result.exit_code == 1
    assert "peer_groups.jsonl does not exist" in result.output
