"""Store replicas of a lake (`graft-store serve --backend lake`) as real servers: following writers, identical
answers, push ingest, rebuilds, compaction under lookups, and outages (PostgreSQL stopped, the bucket down, a
corrupt data file)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.compute as pc
import pytest
from store_factory import make_group, make_problem, wait_for
from typer.testing import CliRunner

from graft.schemas import PeerLookupRequest
from graft.services.store_api.cli import app as cli_app
from graft.services.store_api.http.client import StoreClient, StoreError
from graft.services.store_api.http.testing import REPO_ROOT, StoreServer
from graft.services.store_api.lake.config import LakeConfig, LakeUnavailable, lake_connection
from graft.services.store_api.lake.lake import Lake
from graft.services.store_api.tables import groups_table, validate_table

WRITER = Path(__file__).resolve().parent / "helpers" / "lake_writer_proc.py"


def replica(root: Path, lake: LakeConfig, **settings) -> StoreServer:
    """A replica server over the cache `root` (not started)."""
    env = {k: v for k, v in lake.env().items() if k != "GRAFT_LAKE_CATALOG"}
    env |= {"GRAFT_STORE_BACKEND": "lake", "GRAFT_STORE_LAKE_CATALOG": lake.catalog, "GRAFT_STORE_COMPACT_INTERVAL_S": "0"}
    env |= {f"GRAFT_STORE_{name.upper()}": str(value) for name, value in settings.items()}
    return StoreServer(root, env=env)


def commit(lake: Lake, first: int, groups: int, model: str = "model-a", step: int = 0) -> list[str]:
    batch = [make_group(first + i, model, step=step) for i in range(groups)]
    lake.writing.commit(validate_table(groups_table(batch)), [make_problem(first + i) for i in range(groups)])
    return [g.group_id for g in batch]


def lake_prompts(config: LakeConfig) -> list[str]:
    with Lake(config, create=False) as lake:
        rows = lake.reading.rollouts_between(-1, lake.reading.snapshot().id)
    return sorted(pc.unique(rows.column("prompt_id")).to_pylist())


def answers(client: StoreClient, prompts: list[str]) -> dict:
    """Everything a trainer could ask, as comparable values: lookups for several learners, every rollout page."""
    found = {}
    for learner in ("model-a", "model-b", "model-p", "nobody"):
        req = PeerLookupRequest(prompt_ids=prompts, learner_model=learner, groups_per_prompt=16,
                                informative_only=False, min_successes=0)
        table, misses = client.lookup_peer_table(req)
        found[learner] = (table.to_pylist(), misses)
    found["pages"] = [t.to_pylist() for t in client.iter_rollouts(limit=37)]
    return found


def served_group_ids(client: StoreClient, prompts: list[str]) -> list[str]:
    req = PeerLookupRequest(prompt_ids=prompts, learner_model="nobody", groups_per_prompt=16, informative_only=False,
                            min_successes=0)
    ids = client.lookup_peer_table(req)[0].column("group_id").to_pylist()
    return [g for i, g in enumerate(ids) if i == 0 or ids[i - 1] != g]  # one id per returned group


def caught_up(client: StoreClient, snapshot: int) -> bool:
    lake = client.stats().lake
    return lake is not None and lake.snapshot_id is not None and lake.snapshot_id >= snapshot


def test_two_replicas_follow_writers_and_pushes_and_answer_identically(pg_s3_lake, tmp_path):
    Lake(pg_s3_lake).open().close()
    with replica(tmp_path / "a", pg_s3_lake) as a, replica(tmp_path / "b", pg_s3_lake) as b, \
            StoreClient(a.url) as client_a, StoreClient(b.url) as client_b:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT)) | pg_s3_lake.env()
        logs = [tmp_path / f"writer-{w}.log" for w in range(2)]
        writers = [subprocess.Popen([sys.executable, str(WRITER), f"model-{'ab'[w]}", "3", "5", str(log), str(100 * w)],
                                    env=env, stderr=subprocess.PIPE, text=True) for w, log in enumerate(logs)]
        # push ingest at a replica commits to the lake and is served there at once
        pushed = [make_group(500 + i, "model-p") for i in range(3)]
        response = client_a.push_groups(pushed, [make_problem(500 + i) for i in range(3)])
        assert response.accepted_groups == 3 and response.shard is None
        assert all(client_a.get_group(g.group_id) == g for g in pushed)
        again = client_b.push_groups(pushed)
        assert again.accepted_groups == 0 and sorted(again.duplicate_groups) == sorted(g.group_id for g in pushed)
        for writer in writers:
            _, stderr = writer.communicate(timeout=300)
            assert writer.returncode == 0, stderr
        with Lake(pg_s3_lake) as lake:
            newest = lake.reading.snapshot().id
            assert lake.reading.group_ids("model-p") == {g.group_id for g in pushed}
            counts = lake.reading.counts()
        wait_for(lambda: caught_up(client_a, newest) and caught_up(client_b, newest), 120, "both at the newest snapshot")
        prompts = lake_prompts(pg_s3_lake)
        assert answers(client_a, prompts) == answers(client_b, prompts)
        for client in (client_a, client_b):
            stats = client.stats()
            assert stats.backend == "lake" and stats.total_groups == counts["groups"] == 2 * 3 * 5 + 3
            assert stats.total_rollouts == counts["rollouts"] and stats.duplicate_groups == 0
            assert stats.lake.snapshot_id == stats.lake.newest_snapshot_id == newest
            assert stats.lake.snapshot_age_s >= 0 and stats.lake.error is None
            assert stats.lake.data_path == pg_s3_lake.data_path and "password=***" in stats.lake.catalog


def file_digests(directory: Path) -> set[str]:
    return {hashlib.sha256(path.read_bytes()).hexdigest() for path in directory.rglob("*.parquet")}


def test_replica_rebuilt_from_the_lake_answers_as_before(sqlite_lake, tmp_path):
    with Lake(sqlite_lake) as lake:
        for batch in range(6):
            commit(lake, 10 * batch, 4, model=("model-a", "model-b")[batch % 2], step=batch)
    prompts = lake_prompts(sqlite_lake)
    with replica(tmp_path / "a", sqlite_lake) as a, StoreClient(a.url) as client:
        before = answers(client, prompts)
    # it read the writers' data files and cached each as it is (no change feed, no encoding)
    lake_files = file_digests(Path(sqlite_lake.data_path) / "main" / "rollouts")
    assert file_digests(tmp_path / "a" / "rollouts") == lake_files and len(lake_files) == 6
    with Lake(sqlite_lake) as lake:  # merged and expired: the rebuilt replica reads DuckLake's change feed instead
        lake.maintenance.maintain(expire_older_than_s=0, cleanup_older_than_s=3600)
        assert lake.reading.files_added(-1, lake.reading.snapshot().id) is None
    shutil.rmtree(tmp_path / "a")  # a lost cache: the replica builds itself from the lake
    with replica(tmp_path / "a", sqlite_lake) as a, StoreClient(a.url) as client:
        assert answers(client, prompts) == before
    result = CliRunner().invoke(cli_app, ["rebuild", "--root", str(tmp_path / "a"), "--backend", "lake",
                                          "--lake-catalog", sqlite_lake.catalog])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["groups"] == 24
    with replica(tmp_path / "a", sqlite_lake) as a, StoreClient(a.url) as client:
        assert answers(client, prompts) == before


def test_compaction_under_concurrent_lookups_never_shows_a_group_twice_or_loses_one(pg_s3_lake, tmp_path):
    lake = Lake(pg_s3_lake).open()
    committed: list[str] = []
    for batch in range(12):
        committed += commit(lake, 2 * batch, 2, step=batch)
    violations: list[str] = []
    stop = threading.Event()
    seen_by_lookups: set[str] = set()

    def lookups(client: StoreClient, prompts: list[str]) -> None:
        while not stop.is_set():
            ids = served_group_ids(client, prompts)
            if len(ids) != len(set(ids)):
                violations.append(f"a lookup returned a group twice: {sorted(ids)}")
            if not seen_by_lookups <= set(ids):
                violations.append(f"a lookup lost groups it had served: {seen_by_lookups - set(ids)}")
            seen_by_lookups.update(ids)

    def lake_reader() -> None:
        con = lake_connection(pg_s3_lake)
        con.execute(f"ATTACH '{pg_s3_lake.catalog}' AS plain (READ_ONLY)")
        seen: set[str] = set()
        while not stop.is_set():
            rows = con.execute("SELECT group_id, count(*) FROM plain.rollouts GROUP BY 1").fetchall()
            if any(n != 4 for _, n in rows):
                violations.append(f"plain DuckDB saw a group's rows other than once: {[r for r in rows if r[1] != 4]}")
            if not seen <= {g for g, _ in rows}:
                violations.append("plain DuckDB lost groups it had seen")
            seen = {g for g, _ in rows}
        con.close()

    # the replica compacts its own cache too (every second), while DuckLake merges and expires underneath
    with replica(tmp_path / "a", pg_s3_lake, compact_interval_s=1, compact_min_files=2, retired_grace_s=0.5) as a, \
            StoreClient(a.url) as client:
        prompts = [make_group(i).prompt_id for i in range(48)]
        wait_for(lambda: caught_up(client, lake.reading.snapshot().id), 120, "the replica caught up")
        threads = [threading.Thread(target=lookups, args=(client, prompts)), threading.Thread(target=lake_reader)]
        for thread in threads:
            thread.start()
        env = {k: v for k, v in pg_s3_lake.env().items() if k != "GRAFT_LAKE_CATALOG"}
        try:
            for round_index in range(3):
                for batch in range(4):
                    committed += commit(lake, 24 + 8 * round_index + 2 * batch, 2, step=20 + round_index)
                result = CliRunner().invoke(cli_app, ["compact", "--backend", "lake", "--lake-catalog",
                                                      pg_s3_lake.catalog], env=env)
                assert result.exit_code == 0, result.output
                report = json.loads(result.output.strip().splitlines()[-1])
                assert report["files_after"] < report["files_before"]
            newest = lake.reading.snapshot().id
            wait_for(lambda: caught_up(client, newest), 120, "the replica read every commit")
            wait_for(lambda: set(committed) <= seen_by_lookups, 120, "every group served")
        finally:
            stop.set()
            for thread in threads:
                thread.join(120)
        assert not violations, violations[:3]
        assert sorted(served_group_ids(client, prompts)) == sorted(committed)
        # expire every older snapshot and delete merged-away files: a new replica reads the compacted lake (through
        # LakeMaintenance.maintain: `graft-store compact` keeps files lake_file_grace_s, at least MIN_LAKE_FILE_GRACE_S)
        assert lake.maintenance.maintain(expire_older_than_s=0.001, cleanup_older_than_s=0)["snapshots_expired"] > 0
        with replica(tmp_path / "b", pg_s3_lake) as b, StoreClient(b.url) as client_b:
            assert answers(client_b, prompts) == answers(client, prompts)
    lake.close()


def test_catalog_and_bucket_outages_the_replica_keeps_serving_and_catches_up(pg_s3_lake, postgres, moto_s3, tmp_path):
    with Lake(pg_s3_lake) as lake:
        first = commit(lake, 0, 4)
    prompts = [make_group(i).prompt_id for i in range(12)]
    server = replica(tmp_path / "a", pg_s3_lake).start()
    client = StoreClient(server.url, retries=0)
    try:
        before = answers(client, prompts)
        postgres.stop("immediate")  # the catalog goes away
        try:
            wait_for(lambda: client.stats().lake.error, 60, "the replica to notice")
            assert "cannot" in client.stats().lake.error and answers(client, prompts) == before
            refused = r"HTTP 503: cannot (attach|commit to) lake .*refused.*catalog and the storage are up"
            with pytest.raises(StoreError, match=refused):
                client.push_groups([make_group(90)])
            with pytest.raises(LakeUnavailable):
                Lake(pg_s3_lake).open()
        finally:
            postgres.start()
        wait_for(lambda: client.stats().lake.error is None, 60, "the replica to reach the catalog again")
        with Lake(pg_s3_lake) as lake:
            second = commit(lake, 4, 4)
            wait_for(lambda: caught_up(client, lake.reading.snapshot().id), 60, "the new commit")
        assert set(first + second) <= set(served_group_ids(client, prompts))

        server.stop()  # the bucket goes away while the replica is down and the lake moves on
        with Lake(pg_s3_lake) as lake:
            third = commit(lake, 8, 4)
            moto_s3.stop()
            try:
                server.start()  # reaches the catalog, not the data: serves its cache and says why
                assert client.stats().lake.error and "cannot read rollouts from lake" in client.stats().lake.error
                assert set(served_group_ids(client, prompts)) == set(first + second)
            finally:
                moto_s3.start()
            wait_for(lambda: caught_up(client, lake.reading.snapshot().id), 60, "the replica to read the commit it missed")
        assert set(served_group_ids(client, prompts)) == set(first + second + third)
    finally:
        client.close()
        server.stop()


def test_corrupt_data_file_is_set_aside_the_rest_served_and_read_once_restored(pg_s3_lake, moto_s3, tmp_path):
    lake = Lake(pg_s3_lake).open()
    first = commit(lake, 0, 3)
    with replica(tmp_path / "a", pg_s3_lake) as a, StoreClient(a.url) as client_a:
        second = commit(lake, 3, 3, model="model-b")
        broken = lake.reading.snapshot().id
        wait_for(lambda: caught_up(client_a, broken), 60, "replica a read the second commit")
        path = lake.connection.cursor().execute("SELECT DISTINCT filename FROM lake.rollouts WHERE snapshot_id = ?",
                                      [broken]).fetchall()[0][0]
        key = path.removeprefix(f"s3://{moto_s3.bucket}/")
        s3 = moto_s3.client()
        original = s3.get_object(Bucket=moto_s3.bucket, Key=key)["Body"].read()
        s3.put_object(Bucket=moto_s3.bucket, Key=key, Body=b"PAR1" + b"\x17" * (len(original) - 8) + b"PAR1")
        third = commit(lake, 6, 3)
        prompts = [make_group(i).prompt_id for i in range(9)]
        with replica(tmp_path / "b", pg_s3_lake, lake_retry_unreadable_s=1) as b, StoreClient(b.url) as client_b:
            stats = client_b.stats()
            assert stats.lake.unreadable_snapshots == [broken] and stats.lake.error is None
            assert set(served_group_ids(client_b, prompts)) == set(first + third)  # the rest is served
            assert f"lake snapshot {broken} cannot be read" in b.log_tail(20000)
            # replica a read it before the damage: nothing acknowledged is lost while the file is repaired
            assert set(served_group_ids(client_a, prompts)) == set(first + second + third)
            s3.put_object(Bucket=moto_s3.bucket, Key=key, Body=original)
            wait_for(lambda: not client_b.stats().lake.unreadable_snapshots, 60, "the restored snapshot read")
            restored, reference = answers(client_b, prompts), answers(client_a, prompts)
            # rollout pages follow each replica's ingest order, and b read the repaired snapshot last
            assert sorted(str(row) for page in restored.pop("pages") for row in page) == sorted(
                str(row) for page in reference.pop("pages") for row in page)
            assert restored == reference
    lake.close()


def test_replica_that_cannot_reach_the_lake_at_start_says_why(postgres, tmp_path):
    postgres.create_database("replica_wrong_password")
    wrong = LakeConfig(catalog=f"ducklake:postgres:{postgres.dsn('replica_wrong_password', password='not-it')}")
    with pytest.raises(RuntimeError, match="password authentication failed") as error:
        replica(tmp_path / "a", wrong).start()
    assert "not-it" not in str(error.value)
    dead = LakeConfig(catalog="ducklake:postgres:dbname=x host=127.0.0.1 port=9 user=graft")
    with pytest.raises(RuntimeError, match="cannot attach lake"):
        replica(tmp_path / "b", dead, log_level="warning").start()


def insert_plainly(lake: Lake, groups) -> None:
    """Commit groups without the duplicate check, as a writer racing another with the same group ids lands."""
    con = lake.connection.cursor()
    con.register("racing", validate_table(groups_table(groups)))
    con.execute("INSERT INTO lake.rollouts BY NAME SELECT * FROM racing")
    con.unregister("racing")


def test_a_group_committed_twice_is_served_as_its_first_copy(sqlite_lake, tmp_path):
    """DuckLake has no unique keys: two writers racing with one group id both land. A replica keeps the copy
    committed first, whether the later copy comes in the same read of the lake (catching up) or a later poll."""
    first = make_group(1, rewards=[1.0, 0.0, 0.0, 0.0], seed=1)
    group_id = first.group_id
    with Lake(sqlite_lake) as lake:
        commit(lake, 10, 1)
        lake.writing.commit(validate_table(groups_table([first, make_group(2)])))
        # the snapshot right after the first copy's: a new replica reads both in one window (widths 1, 2, 4, ...)
        # and drops the later copy there
        insert_plainly(lake, [make_group(1, rewards=[0.0, 1.0, 1.0, 1.0], seed=2, group_id=group_id), make_group(3)])
        fresh = [make_group(4)]
        lake.writing.commit(validate_table(groups_table(fresh)))
        with replica(tmp_path / "a", sqlite_lake) as a, StoreClient(a.url) as client:
            wait_for(lambda: caught_up(client, lake.reading.snapshot().id), 120, "the replica caught up")
            assert client.get_group(group_id) == first
            assert client.stats().total_groups == 5  # 10, 1 (once), 2, 3, 4
            assert client.stats().duplicate_groups == 1  # the later copy: counted, not dropped unseen
            insert_plainly(lake, [make_group(1, seed=3, group_id=group_id), make_group(5)])  # while it follows
            wait_for(lambda: caught_up(client, lake.reading.snapshot().id), 120, "the replica read the later copy")
            assert client.get_group(group_id) == first
            assert client.stats().total_groups == 6 and client.stats().duplicate_groups == 2


# ---------------------------------------------------------------------------------------------- issue 23


def test_a_conflicting_push_is_409_and_a_conflicting_copy_that_lands_is_counted(sqlite_lake, tmp_path):
    """A replica refuses a group id the lake holds under another model (as the local store: 409); a copy that
    lands anyway (a plain DuckDB insert, two writers racing) is counted in /v1/stats and logged, not dropped
    unseen."""
    stored = make_group(1, "model-a")
    with Lake(sqlite_lake) as lake:
        lake.writing.commit(validate_table(groups_table([stored])))
        with replica(tmp_path / "a", sqlite_lake) as a, StoreClient(a.url) as client:
            with pytest.raises(StoreError) as refused:
                client.push_groups([make_group(1, "model-b", group_id=stored.group_id), make_group(2, "model-b")])
            assert refused.value.status_code == 409 and stored.group_id in refused.value.message
            assert lake.reading.group_ids("model-b") == set()
            insert_plainly(lake, [make_group(1, "model-b", group_id=stored.group_id), make_group(3, "model-b")])
            insert_plainly(lake, [make_group(1, "model-a", seed=5, group_id=stored.group_id)])  # same model, prompt
            wait_for(lambda: caught_up(client, lake.reading.snapshot().id), 120, "the replica read the copies")
            stats = client.stats()
            assert (stats.conflicting_groups, stats.duplicate_groups, stats.total_groups) == (1, 1, 2)
            assert client.get_group(stored.group_id) == stored
            assert f"{stored.group_id}" in a.log_tail(20000)


def test_a_problem_row_the_model_refuses_is_set_aside_and_later_snapshots_followed(sqlite_lake, tmp_path):
    """A plain DuckDB client may insert a problem whose prompt_id is not the hash of its text: the replica sets
    that snapshot aside, says so in /v1/stats, and follows the snapshots after it."""
    with Lake(sqlite_lake) as lake:
        first = commit(lake, 0, 2)
        lake.connection.cursor().execute("INSERT INTO lake.problems VALUES ('0123456789abcdef', 'toy-math', 'not its text', '1')")
        bad = lake.reading.snapshot().id
        later = commit(lake, 2, 2)
        with replica(tmp_path / "a", sqlite_lake) as a, StoreClient(a.url) as client:
            wait_for(lambda: caught_up(client, lake.reading.snapshot().id), 120, "the replica followed past the bad row")
            stats = client.stats()
            assert stats.lake.unreadable_snapshots == [bad] and stats.lake.error is None
            assert set(served_group_ids(client, [make_group(i).prompt_id for i in range(4)])) == set(first + later)
            assert f"lake snapshot {bad} cannot be read" in a.log_tail(20000)


def test_any_error_in_the_follow_loop_shows_in_the_lake_stats(sqlite_lake, tmp_path):
    """Not only the lake's own errors: a cache the replica cannot write (here a file where a model's folder
    goes) is said in /v1/stats' lake.error, and the replica reads on once it can."""
    from graft.services.store_api.lake.replica import LakeReplica
    from graft.services.store_api.settings import StoreSettings

    settings = StoreSettings(root=tmp_path / "a", backend="lake", lake_catalog=sqlite_lake.catalog,
                             lake_data_path=sqlite_lake.data_path, compact_interval_s=0)
    with Lake(sqlite_lake) as lake:
        first = commit(lake, 0, 2)
        cache = LakeReplica(settings).open()
        try:
            blocker = tmp_path / "a" / "rollouts" / "model=model-b"
            blocker.write_text("not a folder")
            commit(lake, 2, 2, model="model-b")
            assert cache.follow() == 0
            error = cache.stats().lake.error
            assert error is not None and "model=model-b" in error
            blocker.unlink()
            assert cache.follow() == 2 and cache.stats().lake.error is None
            assert cache.stats().total_groups == len(first) + 2
        finally:
            cache.close()


def test_groups_without_mu_go_through_the_lake_and_a_replica_leaves_them_out_when_asked(sqlite_lake, tmp_path):
    """Rows without behaviour logprobs (logprobs_mode 'none') commit to the lake, read back with plain DuckDB, and a
    replica serves them whole, or, under require_behaviour_logprobs, the group with mu (or a miss that says why)."""
    text_only = make_group(70, "text-peer", step=4, without_mu=True)
    newer_text = make_group(71, "text-peer", step=4, without_mu=True)
    older_mu = make_group(71, "peer", step=1)
    with Lake(sqlite_lake) as lake:
        lake.writing.commit(validate_table(groups_table([text_only, newer_text])), [make_problem(70), make_problem(71)])
        lake.writing.commit(validate_table(groups_table([older_mu])))
        stored = lake.reading.rollouts_between(-1, lake.reading.snapshot().id)
        snapshot = lake.reading.snapshot().id
    none_rows = stored.filter(pc.equal(stored.column("logprobs_mode"), "none"))
    assert none_rows.num_rows == 8 and set(map(len, none_rows.column("token_logprobs").to_pylist())) == {0}
    prompts = [text_only.prompt_id, newer_text.prompt_id]
    with replica(tmp_path / "a", sqlite_lake) as a, StoreClient(a.url) as client:
        wait_for(lambda: caught_up(client, snapshot), 120, "the replica caught up")
        found = client.lookup_peer_groups(PeerLookupRequest(prompt_ids=prompts, learner_model="learner"), validate=True)
        mu_only = client.lookup_peer_groups(PeerLookupRequest(prompt_ids=prompts, learner_model="learner",
                                                              require_behaviour_logprobs=True), validate=True)
    assert found.groups == [text_only, newer_text]
    assert mu_only.groups == [older_mu] and mu_only.miss_reasons == {text_only.prompt_id: "only_without_mu"}
