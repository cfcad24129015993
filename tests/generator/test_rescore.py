"""graft-rescore: mu teacher-forced after the fact equals the mu the sampler recorded, at the sampling the rows state
(never rewritten), conditioned on the prompt the trace followed; rows rescored by the weights shown to be the trace's
author are 'rescored', others 'rescored_unverified'.

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

from graft.schemas import PeerLookupRequest, table_to_groups
from graft.services.generator.config import GeneratorConfig, ImportConfig, RescoreConfig
from graft.services.generator.generate import run_generator
from toy.task import sample_problems, write_problems_jsonl

TOLERANCE = 1e-4  # float32 forward passes of one model: the sampler's logits and a teacher-forced pass
RESCORED, RESCORED_UNVERIFIED = "rescored", "rescored_unverified"  # schemas' constants: the rows' logprobs_mode


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
               "tiny-rescored", "--set", "only_without_mu=false", "--set", "prompt.template=raw"]
    proc = graft_rescore(*command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["groups"], summary["groups_failed"], summary["temperatures"]) == (3, 0, [0.7])
    # graft-generate's rows name the weights' fingerprint: these weights are shown to be their author
    assert summary["logprobs_mode"] == {RESCORED: 3} and summary["prompts_from"] == {"rebuilt": 3}
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
def test_imported_rows_rescored_at_their_own_sampling_after_their_own_prompt(tiny_model_dir, tmp_path):
    """Text-only rows (graft-import, T = 0.6 as stated, the prompt the trace followed kept) rescored by the model: the
    rows keep T = 0.6, the mu is the teacher-forced logprobs after the kept prompt (not graft's template), and the lookup
    that requires mu finds the rescored group only. Imported without a revision, nothing shows these weights wrote the
    text: 'rescored_unverified'; imported with the weights' fingerprint as its revision: 'rescored'."""
    from graft.rollouts.hf_backend import teacher_forced_logprobs
    from graft.rollouts.models import load_model_and_tokenizer, model_fingerprint
    from graft.rollouts.sampling import SamplingParams
    from graft.services.generator.importing import run_import
    from graft.services.store_api.http.client import StoreClient
    from graft.services.store_api.http.testing import StoreServer

    kept = "Q: 39+47=\nA:"  # the prompt the trace followed: not what graft's template builds from the problem
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps({"problem": "39+47=", "sent": kept, "answer": "86",
                                  "completion": ["\\boxed{86}", "\\boxed{85}", "86"]}) + "\n")
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    rebuilt = tokenizer("39+47=", add_special_tokens=False)["input_ids"]  # template raw: the problem's text
    # first as the import of the first graft-rescore stored them (no revision, no prompt kept), then with both
    for kept_prompt, revision, mode in ((False, "", RESCORED_UNVERIFIED), (True, model_fingerprint(tiny_model_dir), RESCORED)):
        store = tmp_path / f"store-{mode}"
        settings = {"prompt_column": "sent", "model_revision": revision} if kept_prompt else {}
        run_import(ImportConfig(files=[str(traces)], model_id="r1", tokenizer=str(tiny_model_dir), store=str(store),
                                temperature=0.6, scoring={"workers": 1}, finish_reason="stop", **settings))
        proc = graft_rescore("--store", str(store), "--source-model", "r1", "--model", str(tiny_model_dir), "--set",
                             "prompt.template=raw")
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert summary["logprobs_mode"] == {mode: 1}
        assert summary["prompts_from"] == {"prompt_text" if kept_prompt else "rebuilt": 1}
        groups = groups_of(store, "r1")
        assert sorted(g.rollouts[0].logprobs_mode for g in groups) == sorted(["none", mode])
        rescored = next(g for g in groups if g.rollouts[0].logprobs_mode == mode)
        assert {round(r.temperature, 6) for r in rescored.rollouts} == {0.6}  # float32 column: the stated 0.6, kept
        prompt_ids = tokenizer(kept, add_special_tokens=False)["input_ids"] if kept_prompt else rebuilt
        for r in rescored.rollouts:
            assert r.prompt_token_ids == prompt_ids and r.prompt_text == (kept if kept_prompt else "39+47=")
            expected = teacher_forced_logprobs(model, prompt_ids, [r.completion_token_ids],
                                               SamplingParams(n=1, temperature=0.6))[0]
            assert max(abs(a - b) for a, b in zip(r.token_logprobs, expected, strict=True)) <= TOLERANCE
        with StoreServer(store) as server, StoreClient(server.url) as client:
            found = client.lookup_peer_groups(PeerLookupRequest(prompt_ids=[rescored.prompt_id], learner_model="learner",
                                                                require_behaviour_logprobs=True), validate=True)
        # mu to a learner that asks for it only when the weights are shown to be the text's author
        assert [g.group_id for g in found.groups] == ([rescored.group_id] if mode == RESCORED else [])


def test_a_served_rescoring_refuses_rows_sampled_otherwise_than_it_can_apply():
    """A vLLM server's prompt logprobs are the temperature-1 distribution without truncation: rows stated at another
    temperature, top-p or top-k are refused (their sampling is never rewritten to fit); greedy rows have no mu at all."""
    from types import SimpleNamespace

    from graft.rollouts.rescoring import HFRescorer, ServedRescorer
    from graft.rollouts.sampling import SamplingParams

    served = ServedRescorer(SimpleNamespace(tokenizer=None, tokenizer_id="tok", eos_token_ids=set()))  # no request made
    assert served.cannot_apply(SamplingParams(n=4)) is None
    for stated in ({"temperature": 0.7}, {"top_p": 0.95}, {"top_k": 20}):
        assert "temperature-1 distribution" in served.cannot_apply(SamplingParams(n=4, **stated))
    assert "greedily" in HFRescorer.cannot_apply(None, SamplingParams(n=4, temperature=0.0))
    assert HFRescorer.cannot_apply(None, SamplingParams(n=4, temperature=0.7, top_k=40)) is None
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):  # no temperature to assume any more
        RescoreConfig(store="s", source_model="m", model="p", temperature=1.0)
