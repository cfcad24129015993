"""Reading a lake by snapshot windows (`LakeReading`, a part of `Lake`): what snapshots after..upto committed, in
commit order.

Readers follow the lake by snapshot: `rollouts_between(after, upto)` returns the rows committed in
snapshots after..upto. When the catalog says those snapshots only added data files that are still as they
were added (`files_added`: the usual case, writers' commits), the files are fetched and decoded as they are,
row ids from the catalog (DuckLake's spec: a file's rows are numbered from its `row_id_start`); otherwise
(merges, deletes, inlined rows, expired snapshots) DuckLake's change feed reads them (the `snapshot_id`
virtual column, which prunes data files by the snapshot that added them and survives merges and expiry).
Readers keep the copy of a group with the lowest `rowid` (DuckLake assigns row ids at commit, in commit order,
and keeps them through compaction), so every reader agrees (`first_copies`); a replica counts the others in
its stats.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from graft.schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.lake.config import LakeError
from graft.services.store_api.lake.connection import ALIAS, LakeConnection

# changes a snapshot records (ducklake_snapshot_changes) that add no rows to a table that existed before it
_ADDS_NO_ROWS = {"created_schema", "created_table", "altered_table", "merge_adjacent"}
# what rollouts_between returns: each row's DuckLake row id and the snapshot that added it, then the stored columns
ROLLOUT_ROWS_SCHEMA = pa.schema([pa.field("rowid", pa.int64()), pa.field("snapshot_id", pa.int64()),
                                 *ROLLOUT_ARROW_SCHEMA])


@dataclass(frozen=True)
class Snapshot:
    """A committed DuckLake snapshot."""

    id: int
    time_us: int  # microseconds since the epoch (UTC)

    @property
    def time(self) -> datetime:
        return datetime.fromtimestamp(self.time_us / 1e6, tz=timezone.utc)


@dataclass(frozen=True)
class DataFile:
    """A Parquet data file a snapshot added to the rollouts table, still as it was added."""

    snapshot_id: int  # the snapshot that added it: its rows' snapshot_id
    path: str  # s3://bucket/key or a local path
    rows: int
    row_id_start: int  # its rows' row ids are row_id_start, row_id_start + 1, ... in file order (DuckLake's spec)


@dataclass(frozen=True)
class AddedRows:
    """Rows some snapshots added to the rollouts table, and the bytes of those data files that can be kept as they
    are: files whose Parquet schema is exactly ROLLOUT_ARROW_SCHEMA (the files graft's writers write, with the
    local shards' codecs), so a copy is a local shard of the same rows (a replica caches them without encoding)."""

    rows: pa.Table  # ROLLOUT_ROWS_SCHEMA, in commit order
    bodies: dict[int, tuple[int, bytes]]  # row id of a file's first row -> (its rows, its bytes)



class LakeReading:
    """The newest snapshot, and the rows and problems snapshot windows added, through the lake's connection. Owns
    the newest snapshot read."""

    def __init__(self, connection: LakeConnection):
        self.connection = connection
        self._last_snapshot: Snapshot | None = None  # the newest Snapshot read, kept while it is the newest

    def snapshot(self) -> Snapshot:
        """The newest committed snapshot (a replica asks every poll: one catalog query when nothing changed)."""
        def work(con):
            snapshot_id = int(con.execute(f"SELECT id FROM {ALIAS}.current_snapshot()").fetchall()[0][0])
            last = self._last_snapshot
            if last is not None and last.id == snapshot_id:
                return last
            # the catalog's snapshot table (DuckLake's spec), filtered in the catalog database
            rows = con.execute(f"SELECT epoch_us(CAST(snapshot_time AS TIMESTAMPTZ)) "  # (SQLite keeps text)
                               f"FROM __ducklake_metadata_{ALIAS}.ducklake_snapshot WHERE snapshot_id = ?",
                               [snapshot_id]).fetchall()
            self._last_snapshot = Snapshot(snapshot_id, int(rows[0][0]) if rows else 0)
            return self._last_snapshot

        return self.connection.run("read the snapshot of", work)

    def rollouts_between(self, after: int, upto: int, change_feed: bool = False) -> pa.Table:
        """Rows committed in snapshots after+1..upto, in commit order (snapshot id, then row id), in
        ROLLOUT_ARROW_SCHEMA, with the `rowid` and `snapshot_id` columns first. Groups are contiguous (each was
        inserted in one statement)."""
        return self.rollouts_added(after, upto, change_feed).rows

    def rollouts_added(self, after: int, upto: int, change_feed: bool = False) -> AddedRows:
        """`rollouts_between`'s rows, with the bytes of the data files that can be kept as they are.

        When those snapshots only added data files (`files_added`), the files are read as they are (one GET and
        pyarrow's decoding: ~9 us per rollout, against ~20 through DuckDB's change feed); otherwise, or with
        `change_feed`, DuckLake's change feed reads them (no bytes then). Both give the same rows
        (tests/store/test_lake.py).
        """
        files = None if change_feed else self.files_added(after, upto)
        added = None if files is None else self._read_files(files)
        if added is not None:
            return added
        rows = self._changes("rollouts", ROLLOUT_ARROW_SCHEMA.names, after, upto, ["rowid", "snapshot_id"])
        return AddedRows(_in_commit_order(rows).cast(ROLLOUT_ROWS_SCHEMA), {})

    def files_added(self, after: int, upto: int) -> list[DataFile] | None:
        """The data files snapshots after+1..upto added to the rollouts table, in commit order, when reading them
        is reading what those snapshots inserted: the catalog still has every one of the snapshots, each only
        inserted rows as data files (writers' commits, plain INSERTs: no inlined rows or deletes), and every file
        is still as it was added (live, not encrypted, holding no rows of a merge).
        Then a file's rows are its snapshot's, with row ids row_id_start.. in file order (DuckLake's catalog
        spec). Snapshots that made tables or merged files add no rows; a merge that rewrote any of the window's
        files shows in those files. None otherwise: the caller reads DuckLake's change feed."""
        def work(con):
            meta = f"__ducklake_metadata_{ALIAS}"
            window = _snapshot_changes(con, after, upto)
            if window is None or "rollouts" not in window.tables.values():
                return None
            inserting = set()  # snapshots that inserted into the rollouts table
            for snapshot, kind, table in window.changes:
                if kind in _ADDS_NO_ROWS:
                    continue
                if kind != "inserted_into_table" or table not in window.tables:
                    return None  # deletes, inlined rows, a table named not numbered: the change feed's
                if window.tables[table] == "rollouts":
                    inserting.add(snapshot)
            rollouts_id = next(t for t, name in window.tables.items() if name == "rollouts")
            # the files those snapshots added, and any merged file holding rows of theirs
            rows = con.execute(f"""
                SELECT begin_snapshot, path, path_is_relative, record_count, row_id_start,
                       end_snapshot IS NULL AND row_id_start IS NOT NULL AND partial_max IS NULL
                         AND encryption_key IS NULL AND lower(file_format) = 'parquet' AS as_added
                FROM {meta}.ducklake_data_file
                WHERE table_id = ? AND begin_snapshot <= ? AND coalesce(partial_max, begin_snapshot) > ?
                ORDER BY begin_snapshot, row_id_start""", [int(rollouts_id), upto, after]).fetchall()
            if not all(as_added for *_, as_added in rows) or {row[0] for row in rows} != inserting:
                return None
            files = [DataFile(int(snapshot), path if not relative else self.connection.rollouts_path + path, int(count),
                              int(row_id_start)) for snapshot, path, relative, count, row_id_start, _ in rows]
            # only S3 and paths are fetched here: a file on other storage DuckDB reaches (gs://, az://, https://) is
            # read through the change feed
            if any(re.match(r"[a-z][a-z0-9+.-]*://", f.path) and not f.path.startswith("s3://") for f in files):
                return None
            return files

        return self.connection.run("read the data files of", work)

    def _read_files(self, files: list[DataFile]) -> AddedRows | None:
        """The rows of data files (`files_added`) with their row ids and snapshot ids, in commit order; None when a
        file's columns are not the rollouts table's by name (then the change feed reads it, as DuckDB would).
        A file that cannot be fetched or decoded, or holds another number of rows than the catalog says, raises
        LakeError / pa.ArrowException, as a damaged file read through DuckDB does."""
        parts, bodies = [ROLLOUT_ROWS_SCHEMA.empty_table()], {}
        for file in files:
            body = self.connection.get_file(file.path)
            rows = pq.read_table(pa.BufferReader(body))
            if rows.schema.names != ROLLOUT_ARROW_SCHEMA.names:
                return None
            if rows.num_rows != file.rows:
                lake = self.connection.config.describe()
                raise LakeError(f"lake {lake}: data file {file.path} of snapshot {file.snapshot_id} "
                                f"holds {rows.num_rows} rows, its catalog {file.rows}")
            if rows.schema.equals(ROLLOUT_ARROW_SCHEMA):  # types and nullability; metadata aside
                bodies[file.row_id_start] = (file.rows, body)
            row_ids = np.arange(file.row_id_start, file.row_id_start + file.rows, dtype=np.int64)  # (rows,)
            parts.append(pa.Table.from_arrays(
                [pa.array(row_ids), pa.array(np.full(file.rows, file.snapshot_id, np.int64)),
                 *rows.cast(ROLLOUT_ARROW_SCHEMA).columns], schema=ROLLOUT_ROWS_SCHEMA))
        return AddedRows(pa.concat_tables(parts), bodies)

    def problems_between(self, after: int, upto: int) -> pa.Table:
        """Problems committed in snapshots after+1..upto, in PROBLEM_ARROW_SCHEMA."""
        return self._changes("problems", PROBLEM_ARROW_SCHEMA.names, after, upto, [])

    def tables_inserted_into(self, after: int, upto: int) -> set[str] | None:
        """Names of the tables that snapshots after+1..upto inserted rows into, from the catalog's own record of
        each snapshot's changes (one small catalog query; a change-feed query costs ~15-35 ms of CPU even when it
        finds nothing). None when the catalog no longer has every one of those snapshots (expired) or records a
        change this cannot read: then the caller reads every table."""
        def work(con):
            window = _snapshot_changes(con, after, upto)
            if window is None:
                return None
            inserted = set()
            for _, kind, table in window.changes:
                # rows inserted as data files, or inlined into the catalog (a plain DuckDB client's small inserts)
                if kind in ("inserted_into_table", "inlined_insert"):
                    if table not in window.tables:
                        return None  # a table named, not numbered (made in the same snapshot), or unknown
                    inserted.add(window.tables[table])
            return inserted

        return self.connection.run("read the snapshots of", work)

    def _changes(self, table: str, columns: list[str], after: int, upto: int, extra: list[str]) -> pa.Table:
        """Rows a table gained in snapshots after+1..upto (in no particular order).

        DuckLake's change feed (`table_changes`) opens only the data files those snapshots added, so a poll costs
        what is new and a damaged file spoils only the snapshots it holds. The feed starts at a snapshot the
        catalog still has: after expiry, at the newest one not after after+1 (rows keep the id of the snapshot
        that added them, so filtering on it gives the same rows); if none is left, at the table itself, filtered
        on that id (which opens every data file's footer).
        """
        select = ", ".join([*extra, *columns])

        def changes(con, start: int) -> pa.Table:
            return con.execute(f"""
                SELECT {select} FROM {ALIAS}.table_changes('{table}', ?, ?)
                WHERE change_type = 'insert' AND snapshot_id > ?""",
                               [start, upto, after]).arrow().read_all()

        def work(con):
            try:
                return changes(con, after + 1)
            except duckdb.CatalogException as exc:  # the table was created after `upto`: nothing to read
                if "does not exist at version" not in str(exc):
                    raise
                return con.execute(f"SELECT {select} FROM {ALIAS}.{table} LIMIT 0").arrow().read_all()
            except duckdb.InvalidInputException as exc:
                if "no snapshot found" not in str(exc).lower():
                    raise
            start = con.execute(f"SELECT max(snapshot_id) FROM {ALIAS}.snapshots() WHERE snapshot_id <= ?",
                                [after + 1]).fetchall()[0][0]
            if start is not None:
                try:
                    return changes(con, start)
                except duckdb.InvalidInputException as exc:
                    if "no snapshot found" not in str(exc).lower():
                        raise
            return con.execute(f"""
                SELECT {select} FROM {ALIAS}.{table} WHERE snapshot_id > ? AND snapshot_id <= ?""",
                               [after, upto]).arrow().read_all()

        return self.connection.run(f"read {table} from", work)

    def iter_rollouts(self, after: int, upto: int, max_rows: int = 32768) -> Iterator[tuple[int, pa.Table]]:
        """The rows of snapshots after+1..upto as (last snapshot id covered, rows of `rollouts_between`) windows
        of about `max_rows` rows: the window's width in snapshot ids adapts to the rows the previous one held (a
        row's snapshot id is the one that added it, kept when that snapshot is expired or its file merged)."""
        width = 1
        while after < upto:
            end = min(upto, after + width)
            rows = self.rollouts_between(after, end)
            yield end, rows
            after = end
            width = next_window(width, rows.num_rows, max_rows)

    def group_ids(self, model_id: str, model_revision: str | None = None, policy_step: int | None = None) -> set[str]:
        """Ids of the model's stored groups (optionally of one revision and policy step)."""
        def work(con):
            rows = con.execute(f"""
                SELECT DISTINCT group_id FROM {ALIAS}.rollouts WHERE model_id = ?
                  AND (? IS NULL OR model_revision = ?) AND (? IS NULL OR policy_step = ?)""",
                               [model_id, model_revision, model_revision, policy_step, policy_step]).arrow().read_all()
            return set(rows.column("group_id").to_pylist())

        return self.connection.run("read group ids from", work)

    def group_prompts(self, model_id: str, model_revision: str, policy_step: int) -> dict[str, tuple[str, str]]:
        """group id -> (prompt id, generator id) of the model's stored groups of one revision and policy step (a
        resuming generator's check for groups its settings did not sample)."""
        def work(con):
            rows = con.execute(f"""
                SELECT DISTINCT group_id, prompt_id, generator_id FROM {ALIAS}.rollouts
                WHERE model_id = ? AND model_revision = ? AND policy_step = ?""",
                               [model_id, model_revision, policy_step]).arrow().read_all()
            return dict(zip(rows.column("group_id").to_pylist(),
                            zip(rows.column("prompt_id").to_pylist(), rows.column("generator_id").to_pylist())))

        return self.connection.run("read group ids from", work)

    def counts(self) -> dict[str, int]:
        """Rows, distinct groups and data files of the rollouts table at the newest snapshot."""
        def work(con):
            rows, groups = con.execute(
                f"SELECT count(*), count(DISTINCT group_id) FROM {ALIAS}.rollouts").fetchall()[0]
            files = con.execute(f"SELECT count(*) FROM ducklake_list_files('{ALIAS}', 'rollouts')").fetchall()[0][0]
            return {"rollouts": int(rows), "groups": int(groups), "files": int(files)}

        return self.connection.run("count", work)


@dataclass(frozen=True)
class _WindowChanges:
    """What the catalog records of snapshots after+1..upto (DuckLake's ducklake_snapshot_changes)."""

    changes: list[tuple[int, str, str]]  # (snapshot, kind, target) of each change, e.g. (7, "inserted_into_table", "2")
    tables: dict[str, str]  # table id (as the changes write it) -> name, of the live rollouts and problems tables


def _snapshot_changes(con: duckdb.DuckDBPyConnection, after: int, upto: int) -> _WindowChanges | None:
    """The changes snapshots after+1..upto made, or None when the catalog no longer has every one of them
    (expired; snapshot ids are consecutive)."""
    meta = f"__ducklake_metadata_{ALIAS}"
    rows = con.execute(f"""
        SELECT snapshot_id, changes_made FROM {meta}.ducklake_snapshot_changes
        WHERE snapshot_id > ? AND snapshot_id <= ?""", [after, upto]).fetchall()
    if len(rows) != upto - after:
        return None
    tables = dict(con.execute(f"""
        SELECT CAST(table_id AS VARCHAR), table_name FROM {meta}.ducklake_table
        WHERE table_name IN ('rollouts', 'problems') AND end_snapshot IS NULL""").fetchall())
    changes = [(int(snapshot), *entry.partition(":")[::2]) for snapshot, made in rows for entry in (made or "").split(",")]
    return _WindowChanges(changes, tables)



def _in_commit_order(rows: pa.Table) -> pa.Table:
    """Rows sorted by (snapshot_id, rowid). DuckDB's ORDER BY moves every column of these wide rows (~10% of a
    read's CPU); the change feed mostly returns them in this order already, which costs one pass to check."""
    if rows.num_rows < 2:
        return rows
    snapshots = rows.column("snapshot_id").to_numpy()  # (rows,) int64
    row_ids = rows.column("rowid").to_numpy()  # (rows,) int64
    steps = np.diff(snapshots)  # (rows - 1,)
    if ((steps > 0) | ((steps == 0) & (np.diff(row_ids) > 0))).all():
        return rows
    return rows.take(pc.sort_indices(rows, [("snapshot_id", "ascending"), ("rowid", "ascending")]))


def first_copies(rows: pa.Table, held: Container[str]) -> tuple[pa.Table, pa.Table]:
    """Lake rows (ROLLOUT_ROWS_SCHEMA, commit order) split into the first copy of each group not in `held`, and
    the first row of each copy left out (a later copy: writers racing with one group id both land; or a group in
    `held`), in ROLLOUT_ROWS_SCHEMA.

    A group's rows are contiguous in a snapshot (each was inserted in one statement), so a copy is a run of one
    group id in one snapshot; a group met twice keeps its earliest run. Decided per run: the wide rows are copied
    only if some are left out.
    """
    n = rows.num_rows
    if not n:
        return rows, rows
    ids = rows.column("group_id").combine_chunks()
    snapshot_ids = rows.column("snapshot_id").to_numpy()  # (rows,) ascending
    new_run = np.ones(n, bool)  # (rows,) row i starts a run
    new_run[1:] = pc.not_equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    new_run[1:] |= snapshot_ids[1:] != snapshot_ids[:-1]
    starts = np.flatnonzero(new_run)  # (runs,)
    lengths = np.diff(np.append(starts, n))  # (runs,)
    run_ids = ids.take(pa.array(starts)).to_pylist()  # (runs,)
    first: dict[str, int] = {}  # group id -> its earliest run
    for run, gid in enumerate(run_ids):
        if gid not in held:
            first.setdefault(gid, run)
    keep = np.fromiter((first.get(g) == run for run, g in enumerate(run_ids)), bool, len(starts))  # (runs,)
    if keep.all():
        return rows, rows.slice(0, 0)
    return rows.filter(pa.array(np.repeat(keep, lengths))), rows.take(pa.array(starts[~keep]))


def next_window(width: int, rows: int, max_rows: int) -> int:
    """The width in snapshot ids of the next window read from a lake, after one of `width` held `rows` rows."""
    if rows > max_rows:
        return max(1, width // 2)
    return width * 2 if rows < max_rows // 4 else width
