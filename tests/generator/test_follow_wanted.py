"""graft-generate following wanted prompts (issue 58), as real processes against a real store on loopback: killed
with SIGKILL mid-run on a data set that overlaps the wanted prompts, it restarts and resumes (its wanted draws are its
own, not another sampling's); and it samples only the prompts leased to it, never those another generator holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graft.schemas import LeaseRequest, Want, WantedRequest
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer
from toy.task import sample_problems, write_problems_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def generator(world, dataset: Path, store_url: str, log: Path, *settings: str) -> subprocess.Popen:
    """The toy peer, following wanted prompts, in a process of its own (settings: more --set pairs)."""
    command = [sys.executable, "-m", "graft.services.generator.cli", "--model", str(world.peer_dir), "--model-id",
               "toy-peer", "--dataset", str(dataset), "--store", store_url, "--set", "prompt.template=raw",
               "--set", "group_size=8", "--set", "max_tokens=16", "--set", "scoring.workers=1", "--set", "progress=false",
               "--set", "prompts_per_batch=4", "--set", "seed=0", "--set", "continuous=true",
               "--set", "follow_wanted=true", "--set", "idle_sleep_s=0.2"]
    for setting in settings:
        command += ["--set", setting]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=open(log, "a"),
                            stderr=subprocess.STDOUT)


def post_wants(client: StoreClient, problems) -> None:
    client.post_wanted(WantedRequest(learner_model="toy-learner", policy_step=0,
                                     wants=[Want(prompt_id=p.prompt_id, problem=p) for p in problems]))


def stored(client: StoreClient) -> dict[str, tuple[str, str]]:
    """group id -> (prompt id, generator id) of the peer's stored groups."""
    found = {}
    for page in client.iter_rollouts(model="toy-peer"):
        for gid, prompt, gen in zip(*(page.column(c).to_pylist() for c in ("group_id", "prompt_id", "generator_id"))):
            found[gid] = (prompt, gen)
    return found


def wait(predicate, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


def test_a_generator_following_wants_restarts_after_a_kill_and_resumes(toy_world, tmp_path):
    """Its data set holds the wanted prompts too (a generator sampling the learners' own data set): killed (SIGKILL)
    after its first wanted draws are stored, started again with the same command, it resumes (rather than take its own
    wanted draws for another sampling's groups and stop), serves the wants and samples its data set's rounds."""
    wanted = sample_problems(8, seed=5)
    dataset = write_problems_jsonl(wanted + sample_problems(16, seed=6)[8:], tmp_path / "problems.jsonl")
    log = tmp_path / "generator.log"
    with StoreServer(tmp_path / "store") as server, StoreClient(server.url) as client:
        post_wants(client, wanted)
        first = generator(toy_world, dataset, server.url, log)
        try:
            wait(lambda: any(g.startswith("wanted-") for g in stored(client)), first, log)
        finally:
            first.kill()  # SIGKILL: whatever batch it was sampling is lost
            first.wait(timeout=60)
        before = stored(client)
        again = generator(toy_world, dataset, server.url, log, "max_batches=4")
        assert again.wait(timeout=600) == 0, log.read_text()[-3000:]
        after = stored(client)
    assert "OtherSettingsStored" not in log.read_text() and "other settings sampled" not in log.read_text()
    assert len(after) > len(before)  # it went on: more wanted draws and its data set's groups
    assert any(g.startswith("wanted-") for g in set(after) - set(before))
    assert any(not g.startswith("wanted-") for g in after)


def test_a_generator_samples_only_the_wanted_prompts_leased_to_it(toy_world, tmp_path):
    """Another generator holds four of the eight wanted prompts (its lease): this one's wanted batch is the other four,
    not the same prompts in the same order."""
    wanted = sample_problems(8, seed=7)
    dataset = write_problems_jsonl(sample_problems(16, seed=8)[8:], tmp_path / "problems.jsonl")
    log = tmp_path / "generator.log"
    with StoreServer(tmp_path / "store") as server, StoreClient(server.url) as client:
        post_wants(client, wanted)
        held = {p.prompt_id for p in client.lease_wanted(LeaseRequest(
            model_id="toy-peer", generator_id="the-other-generator", limit=4, lease_s=3600)).prompts}
        assert len(held) == 4
        proc = generator(toy_world, dataset, server.url, log, "max_batches=2", "generator_id=this-one")
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        drawn = {prompt for gid, (prompt, _) in stored(client).items() if gid.startswith("wanted-")}
    assert len(drawn) == 4 and not drawn & held and drawn <= {p.prompt_id for p in wanted}
