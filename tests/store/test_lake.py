"""The lake itself (graft.services.store_api.lake.lake): writers' transactions against a real PostgreSQL catalog with data on
moto's S3 server, and a SQLite catalog with data on a local path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from store_factory import make_group, make_problem, wait_for
from typer.testing import CliRunner

from graft.schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.cli import app as cli_app
from graft.services.store_api.lake import config as lake_module
from graft.services.store_api.lake import reading as lake_reading
from graft.services.store_api.lake.config import ExtensionMissing, LakeConfig, LakeError, LakeUnavailable
from graft.services.store_api.lake.connection import ALIAS
from graft.services.store_api.lake.lake import Lake
from graft.services.store_api.local.shards import write_groups
from graft.services.store_api.tables import conform_table, groups_table, validate_table
from testbed.lake_services import free_port

WRITER = Path(__file__).resolve().parent / "helpers" / "lake_writer_proc.py"


def table_of(groups) -> pa.Table:
    return validate_table(groups_table(groups))


def lake_rows(lake: Lake) -> pa.Table:
    """Every row of the lake, in commit order, in ROLLOUT_ARROW_SCHEMA."""
    rows = lake.reading.rollouts_between(-1, lake.reading.snapshot().id)
    return conform_table(rows.drop_columns(["rowid", "snapshot_id"]))


def start_writer(config: LakeConfig, model: str, batches: int, per_batch: int, log: Path, offset: int = 0):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFT_LAKE_", "AWS_"))} | config.env()
    return subprocess.Popen([sys.executable, str(WRITER), model, str(batches), str(per_batch), str(log), str(offset)],
                            env=env, stderr=subprocess.PIPE, text=True)


def log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def done_batches(log: Path) -> dict[int, list[str]]:
    return {int(words[1]): words[2:] for words in log_lines(log) if words[0] == "done"}



def test_commit_reads_back_identical_rows_and_problems(any_lake):
    groups = [make_group(i, "model-a", step=2) for i in range(6)] + [make_group(i, "model-b") for i in range(3)]
    problems = [make_problem(i) for i in range(6)]
    with Lake(any_lake) as lake:
        first = lake.writing.commit(table_of(groups[:6]), problems)
        second = lake.writing.commit(table_of(groups[6:]), problems[:3])
        assert (first.accepted_groups, first.problems_added, second.accepted_groups, second.problems_added) == (6, 6, 3, 0)
        rows = lake_rows(lake)
        assert rows.schema == ROLLOUT_ARROW_SCHEMA
        assert rows.equals(table_of(groups))  # every column, in commit order, unchanged
        stored = lake.reading.problems_between(-1, lake.reading.snapshot().id)
        assert sorted(stored.cast(PROBLEM_ARROW_SCHEMA).to_pylist(), key=str) == sorted(
            [p.model_dump() for p in problems], key=str)
        assert lake.reading.group_ids("model-a", "rev1", 2) == {g.group_id for g in groups[:6]}
        assert lake.reading.group_ids("model-b") == {g.group_id for g in groups[6:]}
    # plain DuckDB reads it with no project code but the extensions
    con = lake_module.lake_connection(any_lake)
    con.execute(f"ATTACH '{any_lake.catalog}' AS plain (READ_ONLY)")
    assert con.execute("SELECT model_id, count(*) FROM plain.rollouts GROUP BY 1 ORDER BY 1").fetchall() == [
        ("model-a", 24), ("model-b", 12)]


def test_retried_commit_adds_nothing(any_lake):
    groups = [make_group(i, "model-a") for i in range(5)]
    with Lake(any_lake) as lake:
        lake.writing.commit(table_of(groups[:3]))
        snapshot = lake.reading.snapshot().id
        again = lake.writing.commit(table_of(groups))  # a retry holding 3 committed groups and 2 new ones
        assert again.accepted_groups == 2 and again.duplicate_groups == sorted(g.group_id for g in groups[:3])
        assert lake.writing.commit(table_of(groups)).accepted_groups == 0
        assert lake.reading.snapshot().id == snapshot + 1  # a commit that adds nothing makes no snapshot
        rows = lake_rows(lake)
        assert rows.num_rows == 5 * 4 and pc.count_distinct(rows.column("rollout_id")).as_py() == 20


@pytest.mark.parametrize("setup", ["postgres+s3", "sqlite+path"])
def test_concurrent_writer_processes_commit_exactly_4n_groups(setup, request, tmp_path):
    config = request.getfixturevalue("pg_s3_lake" if setup == "postgres+s3" else "sqlite_lake")
    Lake(config).open().close()  # the tables exist before the writers race (their creation is tested below)
    batches, per_batch = 4, 6
    logs = [tmp_path / f"writer-{w}.log" for w in range(4)]
    writers = [start_writer(config, f"model-{w % 2}", batches, per_batch, log, offset=1000 * w)
               for w, log in enumerate(logs)]
    for writer in writers:
        _, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr
    expected = {g for log in logs for ids in done_batches(log).values() for g in ids}
    assert len(expected) == 4 * batches * per_batch
    with Lake(config) as lake:
        rows = lake_rows(lake)
    group_ids = rows.column("group_id").to_pylist()
    assert set(group_ids) == expected and len(group_ids) == 8 * len(expected)  # 4N groups, no duplicate rows
    assert pc.count_distinct(rows.column("rollout_id")).as_py() == rows.num_rows


def test_writers_racing_to_create_the_tables(pg_s3_lake, tmp_path):
    logs = [tmp_path / f"writer-{w}.log" for w in range(3)]
    writers = [start_writer(pg_s3_lake, "model-a", 1, 2, log, offset=10 * w) for w, log in enumerate(logs)]
    for writer in writers:
        _, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr
    with Lake(pg_s3_lake, create=False) as lake:
        assert lake.reading.counts()["groups"] == 6


def test_writer_killed_mid_commit_leaves_no_partial_group(pg_s3_lake, moto_s3, tmp_path):
    Lake(pg_s3_lake).open().close()
    per_batch = 150  # ~1 MB of Parquet per commit: the kill lands while data files upload or the catalog commits
    acknowledged: set[str] = set()
    for round_index, delay_s in enumerate((0.0, 0.05, 0.15, 0.4)):
        log = tmp_path / f"round-{round_index}.log"
        writer = start_writer(pg_s3_lake, "model-k", 50, per_batch, log, offset=100_000 * round_index)
        wait_for(lambda: sum(words[0] == "begin" for words in log_lines(log)) >= 2, 120, "a second commit starting")
        time.sleep(delay_s)  # where the kill lands varies; what must hold does not depend on it
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
        acknowledged |= {g for ids in done_batches(log).values() for g in ids}
    with Lake(pg_s3_lake) as lake:
        rows = lake_rows(lake)
        counts = pc.value_counts(rows.column("group_id"))
        assert set(counts.field("counts").to_pylist()) == {8}  # every visible group is whole
        visible = set(counts.field("values").to_pylist())
        assert acknowledged <= visible  # nothing acknowledged is lost
        assert len(visible - acknowledged) <= 4 * per_batch  # at most the batch each kill caught after its commit
        assert len(visible) % per_batch == 0  # whole batches only: one transaction each
        prefix = pg_s3_lake.data_path.removeprefix(f"s3://{moto_s3.bucket}/")

        def data_files() -> set[str]:  # both tables': a killed commit may have uploaded its problems too
            return {p for table in ("rollouts", "problems") for (p,) in lake.connection.cursor().execute(
                f"SELECT data_file FROM ducklake_list_files('lake', '{table}')").fetchall()}

        def stored() -> set[str]:
            return {f"s3://{moto_s3.bucket}/{key}" for key in moto_s3.objects(prefix)}

        orphans = stored() - data_files()  # uploaded by a commit that was killed before the catalog took it
        assert data_files() <= stored()
        report = lake.maintenance.maintain(expire_older_than_s=3600, cleanup_older_than_s=0)
        assert report["orphans_deleted"] == len(orphans)
        assert stored() == data_files()  # orphans and merged-away files deleted
        assert lake_rows(lake).equals(rows)


def test_missing_or_mismatched_extension_names_the_package(monkeypatch):
    real_version = lake_module.importlib.metadata.version

    def version(package):
        if package == "duckdb-extension-httpfs":
            raise lake_module.importlib.metadata.PackageNotFoundError(package)
        if package == "duckdb-extension-postgres":
            return "1.4.3"
        return real_version(package)

    monkeypatch.setattr(lake_module.importlib.metadata, "version", version)
    con = duckdb.connect(config={"autoinstall_known_extensions": False})
    with pytest.raises(ExtensionMissing, match=r"pip install 'duckdb-extension-httpfs==1\.5\.5'"):
        lake_module.load_extensions(con)
    monkeypatch.setattr(lake_module, "EXTENSIONS", {"postgres": "postgres_scanner"})
    with pytest.raises(ExtensionMissing, match=r"duckdb-extension-postgres 1\.4\.3 is installed, DuckDB is 1\.5\.5"):
        lake_module.load_extensions(con)
    monkeypatch.setattr(lake_module.duckdb, "__version__", "2.0.1")
    with pytest.raises(ExtensionMissing, match=r"needs duckdb==1\.5\.5"):
        lake_module.load_extensions(con)


def test_lake_catalog_must_admit_many_processes():
    with pytest.raises(ValueError, match="ducklake:postgres:.*ducklake:sqlite:"):
        LakeConfig(catalog="ducklake:metadata.ducklake")
    assert LakeConfig(catalog="sqlite:/x/c.sqlite").catalog == "ducklake:sqlite:/x/c.sqlite"


def test_unreachable_catalog_and_wrong_password_are_clear_errors(postgres, moto_s3):
    dead = LakeConfig(catalog=f"ducklake:postgres:dbname=x host=127.0.0.1 port={free_port()} user=graft password=s3cret",
                      data_path=f"s3://{moto_s3.bucket}/dead/")
    with pytest.raises(LakeUnavailable, match="cannot attach lake .*(refused|connect)") as error:
        Lake(dead).open()
    assert "s3cret" not in str(error.value) and "password=***" in str(error.value)
    postgres.create_database("wrong_password")
    wrong = LakeConfig(catalog=f"ducklake:postgres:{postgres.dsn('wrong_password', password='not-it')}")
    with pytest.raises(LakeUnavailable, match="password authentication failed") as error:
        Lake(wrong).open()
    assert "not-it" not in str(error.value)


def test_unreachable_bucket_fails_the_commit_and_nothing_lands(pg_s3_lake, moto_s3):
    groups = [make_group(i, "model-a") for i in range(4)]
    with Lake(pg_s3_lake) as lake:
        lake.writing.commit(table_of(groups[:2]))
        before = lake.reading.snapshot().id
        moto_s3.stop()
        try:
            with pytest.raises(LakeUnavailable, match="cannot commit to lake"):
                lake.writing.commit(table_of(groups[2:]))
        finally:
            moto_s3.start()
        assert lake.reading.snapshot().id == before  # the catalog holds nothing of the failed commit
        retry = lake.writing.commit(table_of(groups))  # the writer retries the whole batch once the bucket is back
        assert retry.accepted_groups == 2 and len(retry.duplicate_groups) == 2
        assert lake_rows(lake).equals(table_of(groups))


def test_wrong_s3_credentials_fail_clearly(postgres, tmp_path):
    """moto with IAM authentication on (its own process: the setting is process-wide in moto)."""
    from testbed.lake_services import MotoS3

    with MotoS3(bucket="auth-lake", in_process=False) as s3:
        iam = __import__("boto3").client("iam", endpoint_url=s3.endpoint, aws_access_key_id="x",
                                         aws_secret_access_key="x", region_name="us-east-1")
        iam.create_user(UserName="writer")
        iam.put_user_policy(UserName="writer", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="writer")["AccessKey"]
        __import__("httpx").post(f"{s3.endpoint}/moto-api/reset-auth", content=b"0").raise_for_status()
        catalog = f"ducklake:postgres:{postgres.create_database('wrong_s3_key')}"
        good = LakeConfig(catalog=catalog, data_path="s3://auth-lake/x/", s3_endpoint=s3.endpoint,
                          s3_key_id=key["AccessKeyId"], s3_secret=key["SecretAccessKey"])
        with Lake(good) as lake:
            lake.writing.commit(table_of([make_group(1)]))
            snapshot = lake.reading.snapshot().id
        bad = good.model_copy(update={"s3_secret": "wrong-secret"})
        with Lake(bad) as lake:
            with pytest.raises(LakeUnavailable, match="(?i)(403|forbidden|signature)"):
                lake.writing.commit(table_of([make_group(2)]))
            assert lake.reading.snapshot().id == snapshot


def test_a_lake_of_another_layout_is_refused(sqlite_lake):
    con = lake_module.lake_connection(sqlite_lake)
    con.execute(f"ATTACH '{sqlite_lake.catalog}' AS other (DATA_PATH '{sqlite_lake.data_path}')")
    con.execute("CREATE TABLE other.rollouts (rollout_id VARCHAR)")
    con.close()
    with pytest.raises(LakeError, match="not one this store wrote"):
        Lake(sqlite_lake).open()


def local_rows(root: Path) -> pa.Table:
    """A local store's rows as its index serves them: the first copy of each group, by rollout id."""
    from graft.services.store_api.lake.migrate import local_shards

    seen, pieces = set(), []
    for shard in local_shards(root):
        table = validate_table(pq.read_table(shard))
        fresh = [g for g in pc.unique(table.column("group_id")).to_pylist() if g not in seen]
        seen.update(fresh)
        pieces.append(table.filter(pc.is_in(table.column("group_id"), pa.array(fresh, pa.string()))))
    rows = pa.concat_tables(pieces)
    return rows.take(pc.sort_indices(rows, [("rollout_id", "ascending")]))


def test_migrate_root_to_lake_and_back_is_identical(any_lake, tmp_path):
    root, back = tmp_path / "store", tmp_path / "back"
    for shard in range(3):
        write_groups(root, [make_group(10 * shard + i, "model-a", step=shard) for i in range(5)],
                     [make_problem(10 * shard + i) for i in range(5)])
        write_groups(root, [make_group(10 * shard + i, "model-b", step=shard, rewards=[1.0, None, 0.0])
                            for i in range(4)])
    repeated = pq.read_table(local_shards_of(root, "model-a")[0]).slice(0, 4)  # one group written again, later
    write_groups(root, repeated)
    runner = CliRunner()
    env = {k: v for k, v in any_lake.env().items() if k != "GRAFT_LAKE_CATALOG"}
    to_lake = runner.invoke(cli_app, ["migrate", "--from", str(root), "--to", any_lake.catalog, "--no-progress"], env=env)
    assert to_lake.exit_code == 0, to_lake.output
    report = json.loads(to_lake.output.strip().splitlines()[-1])
    assert report == {"shards": 7, "groups": 27, "rollouts": 3 * (5 * 4 + 4 * 3), "duplicate_groups": 1, "problems": 15,
                      "skipped_shards": 0}
    again = runner.invoke(cli_app, ["migrate", "--from", str(root), "--to", any_lake.catalog, "--no-progress"], env=env)
    assert json.loads(again.output.strip().splitlines()[-1])["groups"] == 0  # idempotent
    to_root = runner.invoke(cli_app, ["migrate", "--from", any_lake.catalog, "--to", str(back), "--no-progress"], env=env)
    assert to_root.exit_code == 0, to_root.output
    assert json.loads(to_root.output.strip().splitlines()[-1])["groups"] == 27
    assert local_rows(back).equals(local_rows(root))
    from graft.services.store_api.lake.migrate import local_problems

    assert sorted(local_problems(back), key=str) == sorted(local_problems(root), key=str)
    with Lake(any_lake) as lake:  # the lake holds exactly the root's rows, in the root's order
        rows = lake_rows(lake)
        assert rows.take(pc.sort_indices(rows, [("rollout_id", "ascending")])).equals(local_rows(root))
    back_again = runner.invoke(cli_app, ["migrate", "--from", any_lake.catalog, "--to", str(back), "--no-progress"],
                               env=env)
    assert json.loads(back_again.output.strip().splitlines()[-1])["groups"] == 0
    bad = runner.invoke(cli_app, ["migrate", "--from", str(root), "--to", str(back)])
    assert bad.exit_code == 2 and "one of each" in bad.output


def local_shards_of(root: Path, model: str) -> list[Path]:
    return sorted((root / "rollouts" / f"model={model}").glob("part-*.parquet"))


def test_lake_page_plain_duckdb_lines_read_the_lake(pg_s3_lake, moto_s3):
    """docs/lake.md's SQL, run as written (only addresses and keys swapped for the test servers') in a bare
    DuckDB with the extensions installed from their wheels: no project code reads the lake."""
    from duckdb_extensions import import_extension

    from testbed.lake_services import S3_KEY_ID, S3_SECRET

    with Lake(pg_s3_lake) as lake:
        lake.writing.commit(table_of([make_group(i, "model-a") for i in range(3)] + [make_group(i, "model-b") for i in range(2)]))
    page = (Path(__file__).resolve().parents[2] / "docs" / "lake.md").read_text()
    sql = page.split("Plain DuckDB reads the lake", 1)[1].split("```sql\n", 1)[1].split("```", 1)[0]
    sql = (sql.replace("KEY_ID 'graft'", f"KEY_ID '{S3_KEY_ID}'").replace("'graft-lake-secret'", f"'{S3_SECRET}'")
           .replace("'127.0.0.1:9000'", f"'{moto_s3.endpoint.removeprefix('http://')}'")
           .replace("dbname=graft_lake host=127.0.0.1 user=graft password=graft-lake",
                    pg_s3_lake.catalog.removeprefix("ducklake:postgres:")))
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    for extension in ("ducklake", "httpfs", "postgres"):
        import_extension(extension, con=con)
    statements = [statement.strip() for statement in sql.split(";") if statement.strip()]
    for statement in statements[:-2]:
        con.execute(statement)
    assert sorted((m, g) for m, g, _ in con.execute(statements[-2]).fetchall()) == [("model-a", 3), ("model-b", 2)]
    assert con.execute(statements[-1]).arrow().read_all().num_rows == 3  # (Python needs pytz for fetchall here)


def test_snapshots_say_which_tables_they_inserted_into(sqlite_lake):
    """What a replica asks before reading a window of snapshots: a table none of them inserted into is not read."""
    with Lake(sqlite_lake) as lake:
        start = lake.reading.snapshot().id
        lake.writing.commit(table_of([make_group(1)]), [make_problem(1)])
        with_problems = lake.reading.snapshot().id
        lake.writing.commit(table_of([make_group(2)]))
        rollouts_only = lake.reading.snapshot().id
        assert lake.reading.tables_inserted_into(start, with_problems) == {"rollouts", "problems"}
        assert lake.reading.tables_inserted_into(with_problems, rollouts_only) == {"rollouts"}
        assert lake.reading.tables_inserted_into(start, rollouts_only) == {"rollouts", "problems"}
        lake.maintenance.maintain(expire_older_than_s=0, cleanup_older_than_s=3600)  # merges, then expires all but the newest
        assert lake.reading.tables_inserted_into(rollouts_only, lake.reading.snapshot().id) == set()  # a merge inserts nothing new
        assert lake.reading.tables_inserted_into(start, rollouts_only) is None  # expired: unknown, so every table is read


def test_change_feed_rows_are_put_in_commit_order():
    rows = pa.table({"rowid": [5, 1, 2, 7, 3], "snapshot_id": [3, 2, 2, 3, 2], "row": list("abcde")})
    assert lake_reading._in_commit_order(rows).column("row").to_pylist() == ["b", "c", "e", "a", "d"]
    ordered = rows.take([1, 2, 4, 0, 3])
    assert lake_reading._in_commit_order(ordered) is ordered  # already in order: no copy


def test_writers_add_their_own_parquet_files_in_the_partition_layout(any_lake):
    """Writers encode the data files themselves and register them (ducklake_add_data_files): one file per model
    under the table's path in DuckLake's partition layout, so partition pruning and plain DuckDB reads work."""
    groups = [make_group(i, model) for i in range(3) for model in ("model-a", "model-b")]
    with Lake(any_lake) as lake:
        lake.writing.commit(table_of(groups))
        con = lake.connection.cursor()
        files = [path for (path,) in con.execute("SELECT data_file FROM ducklake_list_files('lake', 'rollouts')").fetchall()]
        assert sorted(path.split("/")[-2] for path in files) == ["model_id=model-a", "model_id=model-b"]
        assert all(path.startswith(any_lake.data_path.rstrip("/") + "/main/rollouts/") for path in files)
        pruned = con.execute("EXPLAIN ANALYZE SELECT count(*) FROM lake.rollouts WHERE model_id = 'model-b'").fetchall()
        assert "Total Files Read: 1" in pruned[0][1]
        assert con.execute("SELECT count(*) FROM lake.rollouts WHERE model_id = 'model-b'").fetchall()[0][0] == 12
    plain = duckdb.connect()
    lake_module.load_extensions(plain)
    if any_lake.s3_endpoint:
        plain.execute(lake_module.s3_secret_sql(any_lake))
    plain.execute(f"ATTACH '{any_lake.catalog}' AS plain (READ_ONLY)")
    rows = plain.execute("SELECT * FROM plain.rollouts ORDER BY rollout_id").arrow().read_all()
    expected = table_of(groups)
    assert conform_table(rows).equals(expected.take(pc.sort_indices(expected, [("rollout_id", "ascending")])))


def test_an_encrypted_lake_is_refused_to_writers(tmp_path):
    config = LakeConfig(catalog=f"ducklake:sqlite:{tmp_path / 'catalog.sqlite'}", data_path=str(tmp_path / "data") + "/")
    con = lake_module.lake_connection(config)
    con.execute(f"ATTACH '{config.catalog}' AS made (DATA_PATH '{config.data_path}', ENCRYPTED)")
    con.close()
    with Lake(config) as lake:
        with pytest.raises(LakeError, match="encrypts its data files"):
            lake.writing.commit(table_of([make_group(1)]))
        assert lake.reading.counts()["groups"] == 0


def insert_with_duckdb(config: LakeConfig, groups, inlining_rows: int = 0) -> None:
    """Insert groups as a plain DuckDB client does (DuckDB writes the data file; with `inlining_rows`, up to that
    many rows go into the catalog instead, DuckLake's data inlining)."""
    con = lake_module.lake_connection(config)
    if config.s3_endpoint:
        con.execute(lake_module.s3_secret_sql(config))
    con.execute(f"ATTACH '{config.catalog}' AS plain (DATA_INLINING_ROW_LIMIT {inlining_rows})")
    con.register("incoming", table_of(groups))
    con.execute("INSERT INTO plain.rollouts BY NAME SELECT * FROM incoming")
    con.close()


def test_data_files_read_as_added_give_the_change_feeds_rows(any_lake):
    """Windows of snapshots that only added data files are read file by file (one GET, pyarrow), not through
    DuckLake's change feed: the same rows, row ids and snapshot ids in the same order, whatever the window.
    A window with a merge, or whose files were merged since, goes through the change feed."""
    with Lake(any_lake) as lake:
        start = lake.reading.snapshot().id
        lake.writing.commit(table_of([make_group(i, model) for i in range(3) for model in ("model-a", "model-b")]),
                    [make_problem(1)])
        lake.writing.commit(table_of([make_group(i, "model-a") for i in range(3, 5)]))
        insert_with_duckdb(any_lake, [make_group(5, "model-b"), make_group(6, "model-c")])
        lake.writing.commit(None, [make_problem(2)])  # problems only
        lake.writing.commit(table_of([make_group(7, "model-c")]))
        upto = lake.reading.snapshot().id
        assert [f.snapshot_id - start for f in lake.reading.files_added(start, upto)] == [1, 1, 2, 3, 3, 5]
        for after in range(start, upto):
            for end in range(after + 1, upto + 1):
                added = lake.reading.rollouts_added(after, end)
                assert added.rows.equals(lake.reading.rollouts_between(after, end, change_feed=True)), (after, end)
                # the writers' own files can be kept as they are (the local shards' schema and codecs)
                writers = {f.row_id_start for f in lake.reading.files_added(after, end) if f.snapshot_id - start != 3}
                assert writers <= set(added.bodies)
        everything = lake.reading.rollouts_between(start, upto)
        assert everything.num_rows == 11 * 4 and everything.column("rowid").to_pylist() == list(range(44))
        lake.maintenance.maintain(expire_older_than_s=3600, cleanup_older_than_s=3600)  # merges; expires nothing
        merged = lake.reading.snapshot().id
        assert merged > upto and lake.reading.files_added(start, upto) is None  # its files were merged since
        assert lake.reading.files_added(upto, merged) == []  # the merge snapshot: no rows added
        assert lake.reading.rollouts_between(start, upto).equals(everything)  # the change feed: same rows, same ids
        lake.writing.commit(table_of([make_group(8)]))
        assert len(lake.reading.files_added(merged, lake.reading.snapshot().id)) == 1


def test_rows_inlined_into_the_catalog_are_read(sqlite_lake):
    """A plain DuckDB client's small insert can land in the catalog itself (DuckLake's data inlining), with no
    data file: the snapshot still says rollouts were inserted, and its rows are read (through the change feed)."""
    with Lake(sqlite_lake) as lake:
        lake.writing.commit(table_of([make_group(1)]))
        start = lake.reading.snapshot().id
        small = [make_group(2)]
        insert_with_duckdb(sqlite_lake, small, inlining_rows=1000)
        upto = lake.reading.snapshot().id
        assert lake.reading.tables_inserted_into(start, upto) == {"rollouts"}
        assert lake.reading.files_added(start, upto) is None
        rows = lake.reading.rollouts_between(start, upto)
        assert conform_table(rows.drop_columns(["rowid", "snapshot_id"])).equals(table_of(small))


def test_a_data_file_holding_other_rows_than_its_catalog_says_is_an_error(sqlite_lake):
    with Lake(sqlite_lake) as lake:
        start = lake.reading.snapshot().id
        lake.writing.commit(table_of([make_group(i) for i in range(3)]))
        (file,) = lake.reading.files_added(start, lake.reading.snapshot().id)
        pq.write_table(table_of([make_group(1)]), file.path)  # a valid Parquet file of 4 rows, not 12
        with pytest.raises(LakeError, match=r"holds 4 rows, its catalog 12"):
            lake.reading.rollouts_between(start, lake.reading.snapshot().id)


def test_data_files_on_storage_only_duckdb_reaches_go_through_the_change_feed(sqlite_lake):
    """Files are fetched directly only from S3 or a path; a file DuckDB reaches some other way (gs://, az://,
    https://, a lake made by other tools) is left to DuckLake's change feed."""
    with Lake(sqlite_lake) as lake:
        start = lake.reading.snapshot().id
        lake.writing.commit(table_of([make_group(1)]))
        assert len(lake.reading.files_added(start, lake.reading.snapshot().id)) == 1
        lake.connection.cursor().execute(f"UPDATE __ducklake_metadata_{ALIAS}.ducklake_data_file "
                               "SET path = 'gs://elsewhere/rollouts.parquet', path_is_relative = false")
        assert lake.reading.files_added(start, lake.reading.snapshot().id) is None


# ---------------------------------------------------------------------------------------------- issue 23


def insert_plainly(lake: Lake, groups) -> None:
    """Insert groups with plain DuckDB SQL, no duplicate check: what a plain writer, or a writer racing another
    with the same group ids, lands."""
    con = lake.connection.cursor()
    con.register("plain_rows", table_of(groups))
    con.execute("INSERT INTO lake.rollouts BY NAME SELECT * FROM plain_rows")
    con.unregister("plain_rows")


def test_a_group_id_stored_under_another_model_or_prompt_is_refused(any_lake):
    """As the local store: a group id is unique in the lake, whatever model or prompt the batch is of."""
    from graft.services.store_api.local.mirror import GroupConflict

    stored = make_group(1, "model-a")
    with Lake(any_lake) as lake:
        lake.writing.commit(table_of([stored, make_group(2, "model-a")]))
        before = (lake.reading.snapshot().id, lake.reading.counts())
        other_model = make_group(1, "model-b", group_id=stored.group_id)
        other_prompt = make_group(3, "model-a", group_id=stored.group_id)
        for clash in (other_model, other_prompt):
            with pytest.raises(GroupConflict, match=f"{stored.group_id} \\(stored for model model-a") as refused:
                lake.writing.commit(table_of([make_group(4, "model-b"), clash]))  # the whole batch is refused
            assert set(refused.value.conflicts) == {stored.group_id}
        assert (lake.reading.snapshot().id, lake.reading.counts()) == before and lake.reading.group_ids("model-b") == set()
        again = lake.writing.commit(table_of([stored, make_group(4, "model-b")]))  # the same group again: a duplicate
        assert again.accepted_groups == 1 and again.duplicate_groups == [stored.group_id]


def test_migrate_from_a_lake_keeps_the_first_copy_of_a_group_committed_twice(sqlite_lake, tmp_path):
    """Writers racing with one group id both land (no unique keys); migrate keeps the first copy and counts
    the rest, as a replica does."""
    from graft.services.store_api.local.index import StoreIndex
    from graft.services.store_api.settings import StoreSettings

    first = make_group(1, rewards=[1.0, 0.0, 0.0, 0.0], seed=1)
    with Lake(sqlite_lake) as lake:
        lake.writing.commit(table_of([first, make_group(2)]))
        insert_plainly(lake, [make_group(1, rewards=[0.0, 1.0, 1.0, 1.0], seed=2, group_id=first.group_id)])
        insert_plainly(lake, [make_group(1, "model-b", group_id=first.group_id), make_group(3)])
    root = tmp_path / "back"
    env = {k: v for k, v in sqlite_lake.env().items() if k != "GRAFT_LAKE_CATALOG"}
    result = CliRunner().invoke(cli_app, ["migrate", "--from", sqlite_lake.catalog, "--to", str(root),
                                          "--no-progress"], env=env)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert (report["groups"], report["duplicate_groups"]) == (3, 2)
    index = StoreIndex(StoreSettings(root=root, compact_interval_s=0)).open()
    try:
        table, _ = index.queries.read_selected(lambda: (index.queries.select_group(first.group_id), None))
        assert table.equals(table_of([first]))
        assert index.queries.stats().duplicate_groups == index.queries.stats().conflicting_groups == 0  # the root holds one copy
    finally:
        index.close()


def test_resets_while_other_threads_commit_fail_no_commit(pg_s3_lake):
    """A replica resets its lake connection (retrying unreadable snapshots) while pushes commit on worker
    threads: no commit may see its connection closed under it."""
    import threading

    writers, batches = 3, 8
    errors: list[BaseException] = []
    done = threading.Event()
    with Lake(pg_s3_lake) as lake:
        def write(w: int) -> None:
            try:
                for b in range(batches):
                    lake.writing.commit(table_of([make_group(1000 * w + 10 * b + i, f"model-{w}") for i in range(2)]))
                    lake.reading.snapshot()
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        def reset() -> None:
            while not done.is_set():
                lake.connection.reset()
                time.sleep(0.001)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        resetter = threading.Thread(target=reset)
        resetter.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        done.set()
        resetter.join(timeout=30)
        assert errors == []
        assert lake.reading.counts()["groups"] == writers * batches * 2


def test_lake_file_grace_has_a_floor_of_minutes():
    """A grace of seconds lets `ducklake_delete_orphaned_files` delete a file a writer uploaded but has not
    committed yet (a commit retries for a minute or more)."""
    from pydantic import ValidationError

    from graft.services.store_api.settings import StoreSettings

    for too_short in (0, 1, 299):
        with pytest.raises(ValidationError, match="lake_file_grace_s"):
            StoreSettings(lake_file_grace_s=too_short)
    assert StoreSettings().lake_file_grace_s == 3600


def test_a_lake_of_schema_version_2_gains_the_new_columns_and_reads_its_rows_unchanged(sqlite_lake):
    """A lake made before schema version 3 (no prompt columns, logprob_sum NOT NULL) and holding version-2 rows, one
    group without mu (logprob_sum 0.0): opening it adds the columns (DuckLake's schema evolution, no file rewritten),
    its rows read as they were with null prompt columns, and a version-3 group (null logprob_sum, a prompt) commits."""
    from graft.schemas.rollout import ADDED_COLUMNS
    from graft.services.store_api.lake.connection import LAYOUT_COMMENT, column_ddl

    old_schema = pa.schema([f.with_nullable(False) if f.name == "logprob_sum" else f for f in ROLLOUT_ARROW_SCHEMA
                            if f.name not in ADDED_COLUMNS])
    con = lake_module.lake_connection(sqlite_lake)
    con.execute(f"ATTACH '{sqlite_lake.catalog}' AS old (DATA_PATH '{sqlite_lake.data_path}', DATA_INLINING_ROW_LIMIT 0)")
    con.execute(f"CREATE TABLE old.rollouts ({column_ddl(old_schema)})")
    con.execute("ALTER TABLE old.rollouts SET PARTITIONED BY (model_id)")
    con.execute(f"COMMENT ON TABLE old.rollouts IS '{LAYOUT_COMMENT}'")
    con.execute(f"CREATE TABLE old.problems ({column_ddl(PROBLEM_ARROW_SCHEMA)})")
    version_2 = table_of([make_group(1, "old-peer", without_mu=True), make_group(2, "old-peer")]).drop_columns(
        list(ADDED_COLUMNS))
    version_2 = version_2.set_column(version_2.schema.get_field_index("schema_version"), "schema_version",
                                     pa.array([2] * 8, pa.int32()))
    version_2 = version_2.set_column(version_2.schema.get_field_index("logprob_sum"), "logprob_sum",
                                     pc.fill_null(version_2.column("logprob_sum"), 0.0))
    con.register("incoming", version_2)
    con.execute("INSERT INTO old.rollouts BY NAME SELECT * FROM incoming")
    with pytest.raises(duckdb.Error, match="(?i)not null|constraint"):  # the old table takes no null logprob_sum
        con.execute("INSERT INTO old.rollouts BY NAME SELECT * REPLACE (NULL AS logprob_sum) FROM incoming LIMIT 1")
    con.close()

    new = make_group(3, "new-peer", without_mu=True)
    new = type(new)(rollouts=[r.model_copy(update={"prompt_text": "user: 3+3=\nassistant: ",
                                                   "prompt_token_ids": [5, 6, 7]}) for r in new.rollouts])
    with Lake(sqlite_lake) as lake:
        rows = lake_rows(lake)
        assert rows.drop_columns(list(ADDED_COLUMNS)).equals(validate_table(version_2).drop_columns(list(ADDED_COLUMNS)))
        assert all(rows.column(name).null_count == 8 for name in ADDED_COLUMNS)
        assert lake.writing.commit(table_of([new])).accepted_groups == 1
        stored = lake_rows(lake)
    assert stored.slice(8).equals(table_of([new]))
    assert stored.column("logprob_sum").slice(8).null_count == 4 and stored.column("logprob_sum")[0].as_py() == 0.0
