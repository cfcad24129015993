"""One graft-train run grafts peer groups of the three kinds a store can hold (issue 49): groups the peer sampled with
mu (graft-generate's rows), groups imported from a text-only trace file without mu (graft-import), and imported groups
whose mu was filled in afterwards from the peer's weights (graft-rescore). The metrics say per step how many grafted
rows had mu (peer_rollouts_consumed - peer_rollouts_without_mu, projected: projection_spans) and how many did not
(peer_rollouts_without_mu: b = 1, w = 1; projection_none); rescored rows graft as rows with mu."""

from __future__ import annotations

import json
import shutil

import orjson
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from train_configs import make_config

from graft.rollouts.models import model_fingerprint
from graft.schemas import RESCORED, table_to_groups
from graft.services.generator.config import ImportConfig, RescoreConfig
from graft.services.generator.importing import run_import
from graft.services.generator.rescoring import run_rescore
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local.shards import write_groups
from graft.trainer.loop import train

pytestmark = pytest.mark.slow
SAMPLED, IMPORTED, RESCORED_MODEL = "toy-peer", "trace-peer", "rescored-peer"


def groups_in(root, model_id):
    return [g for shard in sorted((root / "rollouts" / f"model={model_id}").glob("part-*.parquet"))
            for g in table_to_groups(pq.read_table(shard, partitioning=None))]


def write_traces(path, groups, problems):
    """The groups' texts as a trace file (one row per prompt: its completions and the gold), as a trace set holds them."""
    text = {p.prompt_id: p for p in problems}
    path.write_text("".join(json.dumps({"problem": text[g.prompt_id].problem, "answer": text[g.prompt_id].answer,
                                        "completion": [r.completion_text for r in g.rollouts]}) + "\n" for g in groups))
    return path


def test_one_run_grafts_sampled_imported_and_rescored_groups(toy_world, tmp_path):
    problems = toy_world.learner_problems + toy_world.peer_problems
    sampled = {g.prompt_id: g for g in groups_in(toy_world.store_root, SAMPLED)}
    order = [p.prompt_id for p in problems]
    thirds = [[sampled[pid] for pid in order[k::3]] for k in range(3)]  # every third prompt: one kind each
    root = tmp_path / "store"
    write_groups(root, thirds[0], problems)  # with mu, as the peer sampled them
    imported = run_import(ImportConfig(files=[str(write_traces(tmp_path / "b.jsonl", thirds[1], problems))],
                                       model_id=IMPORTED, tokenizer=str(toy_world.peer_dir), store=str(root),
                                       problems=str(toy_world.problems_path), scoring={"workers": 1},
                                       max_tokens=16))
    assert (imported.groups, imported.bad_rows) == (len(thirds[1]), 0)
    side = tmp_path / "side"  # imported, then rescored by the peer's weights; the rescored groups join the store
    # the import names the weights that wrote the traces (their fingerprint): the rescoring is shown to be by the author
    run_import(ImportConfig(files=[str(write_traces(tmp_path / "c.jsonl", thirds[2], problems))], model_id="c-traces",
                            tokenizer=str(toy_world.peer_dir), store=str(side), problems=str(toy_world.problems_path),
                            scoring={"workers": 1}, max_tokens=16, model_revision=model_fingerprint(toy_world.peer_dir)))
    rescored = run_rescore(RescoreConfig(store=str(side), source_model="c-traces", model=str(toy_world.peer_dir),
                                         model_id=RESCORED_MODEL, prompt={"template": "raw"}))
    assert (rescored.groups, rescored.groups_failed) == (len(thirds[2]), 0)
    write_groups(root, groups_in(side, RESCORED_MODEL))
    # the imported rows' rewards are math-verify's against the gold: the sampled groups' own, so as informative
    for group in groups_in(root, IMPORTED):
        assert [r.reward for r in group.rollouts] == [r.reward for r in sampled[group.prompt_id].rollouts]
    assert {r.logprobs_mode for g in groups_in(root, RESCORED_MODEL) for r in g.rollouts} == {RESCORED}

    with StoreServer(root) as server:
        run_dir = train(make_config(toy_world, tmp_path / "run", server.url, steps=3))
    metrics = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    kinds = set()
    for m in metrics:
        models = {g["model_id"] for g in m["grafted_groups"]}
        kinds |= models
        with_mu = m["peer_rollouts_consumed"] - m["peer_rollouts_without_mu"]
        # rows without mu come from the imported groups only, rows with mu from the sampled and the rescored ones
        assert (m["peer_rollouts_without_mu"] > 0) == (IMPORTED in models)
        assert (with_mu > 0) == bool(models & {SAMPLED, RESCORED_MODEL})
        assert m["projection_none"] == m["peer_rollouts_without_mu"] and m["projection_spans"] == with_mu
        assert m["groups_no_peer_tokenizer"] == 0 and m["store_lookup_failures"] == 0
    print([(m["step"], sorted(g["model_id"] for g in m["grafted_groups"]), m["peer_rollouts_consumed"],
            m["peer_rollouts_without_mu"], m["behaviour_ratio_p50"]) for m in metrics])
    assert kinds == {SAMPLED, IMPORTED, RESCORED_MODEL}, f"grafted kinds over the run: {kinds}"
    before, after = load_file(str(toy_world.learner_dir / "model.safetensors")), \
        load_file(str(run_dir / "checkpoints" / "step_000003" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    shutil.rmtree(side)
