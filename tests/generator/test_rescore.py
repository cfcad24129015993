"""graft-rescore: mu teacher-forced after the fact equals the mu the sampler recorded, and rescored rows are ordinary
rows with mu.

The tiny chat model samples groups with graft-generate (hf backend, T = 0.7 and top-k 40: the processed distribution,
not the model's own); graft-rescore teacher-forces the same tokens through the same weights at the rows' temperature.
Every token's rescored logprob must equal the sampled one within 1e-4 (float32; the hf backend's own agreement with a
forward pass, docs/generate.md). The source shards stay byte for byte; the rescored groups are new groups."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from graft.schemas import RESCORED, PeerLookupRequest, table_to_groups
from graft.services.generator.config import GeneratorConfig, ImportConfig, RescoreConfig
from graft.services.generator.generate import run_generator
from toy.task import sample_problems, write_problems_jsonl

TOLERANCE = 1e-4  # float32 forward passes of one model: the sampler's logits and a teacher-forced pass


def graft_rescore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "graft-rescore"), *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def groups_of(store: Path, model_id: str) -> list:
    shards = sorted((store / "rollouts" / f"model={model_id}").glob("part-*.parquet"))
    return [g for shard in shards for g in table_to_groups(pq.read_table(shard, partitioning=None))]


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.parquet"))}


@pytest.mark.slow
def test_rescored_logprobs_equal_the_sampled_ones(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    dataset = write_problems_jsonl(sample_problems(3, seed=11), tmp_path / "problems.jsonl")
    run_generator(GeneratorConfig(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), store=str(store),
                                  prompt={"template": "raw"}, group_size=4, temperature=0.7, top_k=40, max_tokens=12,
                                  seed=3, scoring={"workers": 1}, progress=False))
    sampled = {g.group_id: g for g in groups_of(store, "tiny")}
    assert len(sampled) == 3
    before = digest(store / "rollouts" / "model=tiny")

    command = ["--store", str(store), "--source-model", "tiny", "--model", str(tiny_model_dir), "--model-id",
               "tiny-rescored", "--set", "only_without_mu=false", "--set", "template=raw"]
    proc = graft_rescore(*command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["groups"], summary["groups_failed"], summary["temperatures"]) == (3, 0, [0.7])
    rescored = groups_of(store, "tiny-rescored")
    assert len(rescored) == 3 and not set(g.group_id for g in rescored) & set(sampled)
    worst = 0.0
    for group in rescored:
        source = next(s for s in sampled.values() if s.prompt_id == group.prompt_id)
        for new, old in zip(group.rollouts, source.rollouts, strict=True):
            assert new.logprobs_mode == RESCORED and old.logprobs_mode == "processed"
            assert (new.temperature, new.top_k, new.generator_id) == (old.temperature, 40, "graft-rescore:hf")
            assert new.completion_token_ids == old.completion_token_ids and new.reward == old.reward
            gaps = [abs(a - b) for a, b in zip(new.token_logprobs, old.token_logprobs, strict=True)]
            worst = max(worst, *gaps)
            assert abs(new.logprob_sum - old.logprob_sum) <= TOLERANCE * max(1, new.num_tokens)
    print(f"largest gap between sampled and rescored logprobs: {worst:.3g}")
    assert 0.0 <= worst <= TOLERANCE, f"largest gap {worst}"
    assert digest(store / "rollouts" / "model=tiny") == before  # the source shards are not touched

    again = graft_rescore(*command)
    assert json.loads(again.stdout.strip().splitlines()[-1])["skipped_already_stored"] == 3
    assert len(groups_of(store, "tiny-rescored")) == 3


@pytest.mark.slow
def test_imported_rows_rescored_become_rows_with_mu(tiny_model_dir, tmp_path):
    """Text-only rows (graft-import) rescored by the model: the lookup that requires mu finds the rescored group only."""
    from graft.services.generator.importing import run_import
    from graft.services.store_api.http.client import StoreClient
    from graft.services.store_api.http.testing import StoreServer

    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps({"problem": "39+47=", "completion": ["\\boxed{86}", "\\boxed{85}", "86"], "answer": "86"}) + "\n")
    store = tmp_path / "store"
    run_import(ImportConfig(files=[str(traces)], model_id="r1", tokenizer=str(tiny_model_dir), store=str(store),
                            temperature=0.6, score_workers=1))
    proc = graft_rescore("--store", str(store), "--source-model", "r1", "--model", str(tiny_model_dir), "--set",
                         "template=raw")
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups = groups_of(store, "r1")
    assert sorted(g.rollouts[0].logprobs_mode for g in groups) == ["none", RESCORED]
    rescored = next(g for g in groups if g.has_behaviour_logprobs)
    assert {round(r.temperature, 6) for r in rescored.rollouts} == {0.6}  # float32 column; the import's stated temperature, assumed
    assert all(len(r.token_logprobs) == r.num_tokens and r.logprob_sum < 0 for r in rescored.rollouts)
    with StoreServer(store) as server, StoreClient(server.url) as client:
        found = client.lookup_peer_groups(PeerLookupRequest(prompt_ids=[rescored.prompt_id], learner_model="learner",
                                                            require_behaviour_logprobs=True), validate=True)
    assert [g.group_id for g in found.groups] == [rescored.group_id]


def test_a_served_rescoring_assumes_temperature_one():
    with pytest.raises(ValueError, match="temperature-1 distribution"):
        RescoreConfig(store="s", source_model="m", model="p", backend="openai", temperature=0.7,
                      openai={"base_url": "http://127.0.0.1:9"})
    served = RescoreConfig(store="s", source_model="m", model="p", backend="openai", openai={"base_url": "http://127.0.0.1:9"})
    assert (served.temperature, served.top_p, served.top_k) == (1.0, 1.0, None)
