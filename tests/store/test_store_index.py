"""The DuckDB index: ingest, idempotence, quarantine, rebuild, compaction, lookups and pages (no HTTP)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from datetime import datetime, timedelta, timezone

import pyarrow.parquet as pq
import pytest
from store_factory import make_group, problem_text

from graft.schemas import PeerLookupRequest, prompt_id, table_to_groups
from graft.services.store_api.local.durable import TMP_PREFIX
from graft.services.store_api.local.index import StoreIndex
from graft.services.store_api.local.lookup import LOOKUP_SUFFIX, lookup_path
from graft.services.store_api.local.manifest import live_files
from graft.services.store_api.local.queries import BadCursor
from graft.services.store_api.local.shards import write_groups


def pid(i: int) -> str:
    return prompt_id(problem_text(i))


def lookup(index: StoreIndex, **kwargs):
    req = PeerLookupRequest(**kwargs)
    table, misses = index.queries.read_selected(lambda: index.queries.select_peer_groups(req))
    return table_to_groups(table), misses


def index_rows(index: StoreIndex) -> list[tuple]:
    return index.catalog.cursor().execute("""
        SELECT g.group_id, g.prompt_id, g.dataset, g.model_id, g.model_revision, g.policy_step, g.group_size,
               g.successes, g.mean_reward, g.created_us, f.path, g.row_start, g.num_rows
        FROM groups g JOIN files f USING (file_id) ORDER BY g.group_id""").fetchall()


def test_peer_lookup_semantics(settings):
    root = settings.root
    old = datetime.now(timezone.utc) - timedelta(hours=2)
    write_groups(root, [make_group(i, "learner") for i in range(3)])
    write_groups(root, [make_group(i, "peer-a", step=1) for i in range(3)])
    newest_a = write_groups(root, [make_group(0, "peer-a", step=4, created_at=old)])
    write_groups(root, [make_group(0, "peer-b", step=4)])  # same step as peer-a's, but newer
    write_groups(root, [make_group(1, "peer-b", step=9, rewards=[0.0] * 4)])  # all-fail: not informative
    write_groups(root, [make_group(2, "peer-b", step=9, rewards=[1.0] * 4)])  # all-success
    index = StoreIndex(settings).open()

    groups, misses = lookup(index, prompt_ids=[pid(0), pid(1), pid(2), pid(7)], learner_model="learner")
    assert [(g.prompt_id, g.model_id, g.policy_step) for g in groups] == [
        (pid(0), "peer-b", 4), (pid(1), "peer-a", 1), (pid(2), "peer-a", 1)]
    assert misses == {pid(7): "nothing_stored"}
    assert all(g.informative for g in groups)

    groups, _ = lookup(index, prompt_ids=[pid(0)], learner_model="learner", groups_per_prompt=5)
    assert [(g.model_id, g.policy_step) for g in groups] == [("peer-b", 4), ("peer-a", 4), ("peer-a", 1)]
    assert groups[1].group_id == table_to_groups(pq.read_table(newest_a))[0].group_id

    groups, _ = lookup(index, prompt_ids=[pid(0)], learner_model="learner", peer_models=["peer-a"], groups_per_prompt=5)
    assert {g.model_id for g in groups} == {"peer-a"}
    groups, _ = lookup(index, prompt_ids=[pid(0)], learner_model="learner", max_age_s=3600, groups_per_prompt=5)
    assert [g.policy_step for g in groups] == [4, 1]  # the two-hour-old group is out
    groups, misses = lookup(index, prompt_ids=[pid(0), pid(1)], learner_model="learner", min_policy_step=4)
    assert [g.model_id for g in groups] == ["peer-b"] and misses == {pid(1): "only_uninformative"}  # peer-b's step 9 is all-fail
    groups, _ = lookup(index, prompt_ids=[pid(1), pid(2)], learner_model="learner", informative_only=False,
                       min_successes=0)
    assert [g.successes for g in groups] == [0, 4]  # step 9 beats step 1 once uninformative groups count
    groups, _ = lookup(index, prompt_ids=[pid(2)], learner_model="learner", informative_only=False, min_successes=3)
    assert [g.successes for g in groups] == [4]
    groups, misses = lookup(index, prompt_ids=[pid(0)], learner_model="peer-b", peer_models=["peer-b"])
    assert groups == [] and misses == {pid(0): "peers_not_admitted"}  # the learner's own groups never come back
    index.close()


def test_ingest_is_idempotent_and_logs_duplicates(settings, caplog):
    root = settings.root
    groups = [make_group(i, "model-a") for i in range(6)]
    first = write_groups(root, groups)
    index = StoreIndex(settings).open()
    assert index.queries.group_count() == 6
    assert index.ingest.ingest_new() == 0 and index.ingest.ingest_file(first) == 0  # the same file seen again

    shutil.copy(first, first.with_name("part-zz-copy.parquet"))  # the same groups under another name
    write_groups(root, groups[:2] + [make_group(9, "model-a")])  # two groups again plus a new one
    with caplog.at_level(logging.WARNING, logger="graft.store"):
        assert index.ingest.ingest_new() == 1
    assert "already indexed" in caplog.text and groups[0].group_id in caplog.text
    stats = index.queries.stats()
    assert (stats.total_groups, stats.total_rollouts, stats.duplicate_groups) == (7, 28, 8)
    # the copy added nothing and left the live set; the other file was rewritten with its one new group only
    assert stats.files == 2
    live = pq.ParquetDataset(live_files(root)).read().column("rollout_id").to_pylist()
    assert len(live) == len(set(live)) == 28  # the manifest's files hold each indexed rollout once
    pages, cursor = [], None
    while True:
        table, cursor = index.queries.rollout_page(cursor=cursor, limit=5)
        pages.append(table)
        if cursor is None:
            break
    ids = [r for t in pages for r in t.column("rollout_id").to_pylist()]
    assert len(ids) == len(set(ids)) == 28
    index.close()


def test_corrupt_and_truncated_files_are_quarantined(settings, caplog):
    root = settings.root
    good = write_groups(root, [make_group(i, "model-a") for i in range(4)])
    truncated = write_groups(root, [make_group(i, "model-b") for i in range(4)])
    truncated.write_bytes(truncated.read_bytes()[:-100])
    garbage = root / "rollouts" / "model=model-b" / "part-garbage.parquet"
    garbage.write_bytes(b"not parquet at all" * 50)
    misplaced = write_groups(root, [make_group(5, "model-c")])
    shutil.move(misplaced, root / "rollouts" / "model=model-a" / misplaced.name)
    with caplog.at_level(logging.ERROR, logger="graft.store"):
        index = StoreIndex(settings).open()
    assert index.queries.group_count() == 4
    quarantined = sorted(p.name for p in (root / "quarantine").iterdir() if not p.name.endswith(".reason.txt"))
    assert len(quarantined) == 3 and caplog.text.count("quarantined") == 3
    assert any("model-c" in p.read_text() for p in (root / "quarantine").glob("*.reason.txt"))
    assert index.queries.stats().quarantined_files == 3
    assert not truncated.exists() and not garbage.exists() and good.exists()

    # damage a page of an indexed shard: the lookup that meets it quarantines the file and still answers
    data = bytearray(good.read_bytes())
    data[200:260] = b"\xff" * 60
    good.write_bytes(bytes(data))
    index.catalog.reader.forget(good.relative_to(root).as_posix())
    groups, misses = lookup(index, prompt_ids=[pid(0), pid(1)], learner_model="x")
    assert groups == [] and list(misses) == [pid(0), pid(1)]
    assert index.queries.group_count() == 0 and index.queries.stats().quarantined_files == 4
    assert not lookup_path(good).exists()
    index.close()


def test_restart_and_rebuild_give_the_same_index(settings):
    root = settings.root
    for model in ("model-a", "model-b"):
        for step in range(3):
            write_groups(root, [make_group(i, model, step=step) for i in range(5)])
    index = StoreIndex(settings).open()
    before = index_rows(index)
    assert len(before) == 30
    index.close()

    index = StoreIndex(settings).open()  # restart with the index file
    assert index_rows(index) == before
    assert index.rebuild() == 30  # from the Parquet files alone
    assert index_rows(index) == before
    index.close()
    (root / "index.duckdb").unlink()
    index = StoreIndex(settings).open()
    assert index_rows(index) == before
    groups, _ = lookup(index, prompt_ids=[pid(2)], learner_model="model-a")
    assert [(g.model_id, g.policy_step) for g in groups] == [("model-b", 2)]
    index.close()


def test_compaction_swaps_atomically_while_lookups_run(settings):
    root = settings.root
    settings.compact_target_rows = 200
    expected: dict[str, set[str]] = {}
    for shard in range(12):
        groups = [make_group(p, "peer", step=shard) for p in range(shard % 4, 20, 4)]
        write_groups(root, groups)
        for g in groups:
            expected.setdefault(g.prompt_id, set()).add(g.group_id)
    write_groups(root, [make_group(p, "learner") for p in range(20)])
    index = StoreIndex(settings).open()
    pids = sorted(expected)
    every = PeerLookupRequest(prompt_ids=pids, learner_model="learner", groups_per_prompt=16)
    errors: list[str] = []
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            table, misses = index.queries.read_selected(lambda: index.queries.select_peer_groups(every))
            seen: dict[str, list[str]] = {}
            for g in table_to_groups(table):
                seen.setdefault(g.prompt_id, []).append(g.group_id)
            if misses or {p: set(v) for p, v in seen.items()} != expected or sum(map(len, seen.values())) != 60:
                errors.append(f"misses={misses} counts={ {p: len(v) for p, v in seen.items()} }")

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        report = index.compaction.compact(model_id="peer", min_files=2)
        index.compaction.delete_retired(grace_s=0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert report["files_merged"] == 12 and report["groups_moved"] == 60 and report["files_written"] >= 2
    peer_files = sorted((root / "rollouts" / "model=peer").glob("part-*.parquet"))
    live = index.catalog.cursor().execute(
        "SELECT count(*) FROM files WHERE model_id = 'peer' AND retired_us IS NULL").fetchone()[0]
    assert live == report["files_written"]
    for path in peer_files:
        if index.catalog.cursor().execute("SELECT retired_us FROM files WHERE path = ?",
                                   [path.relative_to(root).as_posix()]).fetchone()[0] is None:
            prompts = pq.read_table(path, columns=["prompt_id"]).column("prompt_id").to_pylist()
            assert prompts == sorted(prompts)  # compacted files are sorted by prompt id
    index.compaction.delete_retired(grace_s=0)
    assert len(list((root / "rollouts" / "model=peer").glob("part-*.parquet"))) == report["files_written"]
    groups, _ = lookup(index, prompt_ids=pids, learner_model="learner", groups_per_prompt=16)
    assert sorted(g.group_id for g in groups) == sorted(set().union(*expected.values()))
    live = sorted((root / "rollouts").rglob("part-*.parquet"))
    assert sorted((root / "lookup").rglob(f"*{LOOKUP_SUFFIX}")) == sorted(lookup_path(p) for p in live)  # old ones deleted
    before = index_rows(index)
    assert index.rebuild() == 80 and index_rows(index) == before
    index.close()


def test_lookup_files_are_rebuilt_when_missing_and_orphans_swept(settings):
    root = settings.root
    shards = [write_groups(root, [make_group(i, model, step=1) for i in range(6)]) for model in ("model-a", "model-b")]
    index = StoreIndex(settings).open()
    want = lookup(index, prompt_ids=[pid(i) for i in range(6)], learner_model="model-a")
    index.close()

    shutil.rmtree(root / "lookup")  # e.g. a store written before lookup files existed
    index = StoreIndex(settings).open()
    index.ingest.open_lookup_files()
    assert all(lookup_path(shard).is_file() for shard in shards)
    assert lookup(index, prompt_ids=[pid(i) for i in range(6)], learner_model="model-a") == want

    # a writer that died between its lookup file and its shard leaves them behind; young ones may be in flight
    model_b = root / "lookup" / "model=model-b"
    orphan = model_b / f"part-died{LOOKUP_SUFFIX}"
    stale_tmp = model_b / f"{TMP_PREFIX}1234-part-died{LOOKUP_SUFFIX}"
    young = model_b / f"part-in-flight{LOOKUP_SUFFIX}"
    for path in (orphan, stale_tmp, young):
        shutil.copy(lookup_path(shards[1]), path)
    for path in (orphan, stale_tmp, lookup_path(shards[1])):
        os.utime(path, (1, 1))
    assert index.ingest.delete_orphan_lookup_files() == 2
    assert not orphan.exists() and not stale_tmp.exists() and young.exists() and lookup_path(shards[1]).exists()
    index.close()


def test_rollout_pages_filter_and_follow_the_cursor(settings):
    root = settings.root
    write_groups(root, [make_group(i, "model-a", step=1, rewards=[1.0, 0.0, 0.5, None]) for i in range(10)])
    write_groups(root, [make_group(i, "model-b", step=7) for i in range(10)])
    index = StoreIndex(settings).open()

    def collect(limit, **filters):
        rows, cursor = [], None
        while True:
            table, cursor = index.queries.rollout_page(cursor=cursor, limit=limit, **filters)
            assert table.num_rows <= limit
            rows += table.to_pylist()
            if cursor is None:
                return rows

    everything = collect(3)
    assert len(everything) == 80 and len({r["rollout_id"] for r in everything}) == 80
    assert [r["rollout_id"] for r in everything] == [r["rollout_id"] for r in collect(1000)]
    correct = collect(7, model="model-a", correct=True)
    assert len(correct) == 20 and all(r["correct"] and r["model_id"] == "model-a" for r in correct)
    assert len(collect(4, min_reward=0.25, max_reward=0.75)) == 10
    assert len(collect(4, min_policy_step=5)) == 40
    assert len(collect(4, max_policy_step=5, correct=False)) == 20  # 0.0 and null rewards
    assert [r["prompt_id"] for r in collect(50, prompt_id=pid(3))] == [pid(3)] * 8
    assert collect(5, dataset="other") == []
    with pytest.raises(BadCursor):
        index.queries.rollout_page(cursor="not-a-cursor")
    index.close()
