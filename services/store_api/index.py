"""The store's index: DuckDB tables of files, groups, duplicates and problems; ingest, rebuild, compaction.

Only the store process opens `<root>/index.duckdb` (DuckDB takes a file lock). The Parquet files are the
source of truth: `rebuild()` recreates the index from them alone, and the reader rebuilds any missing or
damaged lookup file from its shard.

Peer lookups are answered from an in-memory mirror of the groups table (prompt id -> group locations,
most recent first). A DuckDB point query costs 0.3 ms for `SELECT 1` and 1-15 ms for the filtered, ordered
lookup on 125k groups on this machine, against a 2 ms budget for the whole HTTP lookup; the mirror costs
~100 bytes per group (12 MB per million rollouts in groups of 8). Every change commits to DuckDB first and
then applies to the mirror under one lock, so a lookup sees a group before or after a compaction swap,
never twice and never missing. Stats, filtered rollout pages and compaction planning query DuckDB.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import itertools
import logging
import os
import shutil
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import (
    PROBLEM_ARROW_SCHEMA,
    ROLLOUT_ARROW_SCHEMA,
    ModelStats,
    PeerLookupRequest,
    Problem,
    StatsResponse,
)
from services.store_api.shards import (
    LOOKUP_DIR,
    LOOKUP_SUFFIX,
    ROW_GROUP_ROWS,
    GROUP_SHARED_FIELDS,
    TMP_PREFIX,
    ShardReadError,
    ShardReader,
    ShardValidationError,
    check_groups,
    discard,
    group_runs,
    model_dir,
    publish,
    write_problems,
    write_rollout_table,
)
from services.store_api.settings import StoreSettings

log = logging.getLogger("graft.store")

INDEX_VERSION = "1"

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR);
CREATE TABLE IF NOT EXISTS files (
    file_id INTEGER PRIMARY KEY,
    path VARCHAR NOT NULL UNIQUE,      -- relative to the store root
    kind VARCHAR NOT NULL,             -- 'rollouts' or 'prompts'
    model_id VARCHAR,
    num_rows BIGINT NOT NULL,
    size_bytes BIGINT NOT NULL,
    landed_us BIGINT NOT NULL,         -- file mtime, microseconds since the epoch (UTC)
    indexed_us BIGINT NOT NULL,
    groups_indexed INTEGER NOT NULL,
    groups_duplicate INTEGER NOT NULL,
    retired_us BIGINT                  -- set when compaction moved its groups elsewhere
);
CREATE TABLE IF NOT EXISTS groups (
    group_id VARCHAR PRIMARY KEY,
    seq BIGINT NOT NULL,               -- ingest order; cursors of GET /v1/rollouts page by it
    prompt_id VARCHAR NOT NULL,
    dataset VARCHAR NOT NULL,
    model_id VARCHAR NOT NULL,
    model_revision VARCHAR NOT NULL,
    tokenizer_id VARCHAR NOT NULL,
    policy_step BIGINT NOT NULL,
    group_size INTEGER NOT NULL,
    successes INTEGER NOT NULL,
    scored INTEGER NOT NULL,           -- rollouts with a non-null reward
    reward_sum DOUBLE NOT NULL,
    mean_reward DOUBLE,
    min_reward DOUBLE,
    max_reward DOUBLE,
    created_us BIGINT NOT NULL,        -- newest created_at of the group's rollouts
    file_id INTEGER NOT NULL,
    row_start BIGINT NOT NULL,         -- first row of the group in its file
    num_rows INTEGER NOT NULL,
    indexed_us BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS duplicates (group_id VARCHAR NOT NULL, path VARCHAR NOT NULL, seen_us BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS problems (
    dataset VARCHAR NOT NULL, prompt_id VARCHAR NOT NULL, file_id INTEGER NOT NULL, PRIMARY KEY (dataset, prompt_id)
);
"""


def now_us() -> int:
    return time.time_ns() // 1000


def us_to_datetime(us: int | None) -> datetime | None:
    return None if us is None else datetime.fromtimestamp(us / 1e6, tz=timezone.utc)


class GroupRef(NamedTuple):
    """Where one indexed group lives, and what a peer lookup filters on (a named tuple: building one costs
    ~0.6 us against ~6 us for a frozen dataclass, and the ingest loop builds one per group)."""

    group_id: str
    prompt_id: str
    model_id: str
    policy_step: int
    created_us: int
    successes: int
    group_size: int
    seq: int
    file: str  # relative to the store root
    row_start: int
    num_rows: int

    def recency_key(self) -> tuple[int, int, str]:
        """Most recent first: highest policy step, then newest, then group id for a stable order."""
        return (-self.policy_step, -self.created_us, self.group_id)


class IndexLocked(RuntimeError):
    """Another process holds the index (a running store)."""


class BadCursor(ValueError):
    """A `cursor` that this store did not hand out."""


def encode_cursor(seq: int, row: int) -> str:
    return base64.urlsafe_b64encode(f"{seq}:{row}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, int]:
    try:
        seq_text, row_text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().split(":")
        seq, row = int(seq_text), int(row_text)
    except (ValueError, UnicodeDecodeError, binascii.Error) as exc:
        raise BadCursor(f"cursor {cursor!r} is not one this store handed out: pass next_cursor unchanged") from exc
    if seq < 0 or row < 0:
        raise BadCursor(f"cursor {cursor!r} is not one this store handed out: pass next_cursor unchanged")
    return seq, row


# what the index keeps of a shard: the columns a group shares, and what its successes, rewards and time come from
INDEX_COLUMNS = [*GROUP_SHARED_FIELDS, "correct", "reward", "created_at"]


def summarise_shard(path: Path, expected_model: str | None) -> pa.Table:
    """One row per group of a rollout shard, from INDEX_COLUMNS (the other columns are not decoded).

    Raises ShardReadError / ShardValidationError if the file is unreadable or not whole groups of one model.
    """
    try:
        parquet = pq.ParquetFile(path, page_checksum_verification=True)
        schema = parquet.schema_arrow
        wrong = [
            f"{f.name}: {schema.field(f.name).type if f.name in schema.names else 'missing'} (expected {f.type})"
            for f in ROLLOUT_ARROW_SCHEMA
            if f.name not in schema.names or schema.field(f.name).type != f.type
        ]
        if wrong:
            raise ShardValidationError(f"schema differs from ROLLOUT_ARROW_SCHEMA: {'; '.join(wrong[:5])}")
        table = parquet.read(columns=INDEX_COLUMNS, use_threads=False)
    except (OSError, pa.ArrowException) as exc:
        raise ShardReadError(path, str(exc)) from exc
    if table.num_rows == 0:
        raise ShardValidationError("no rows")
    for name in INDEX_COLUMNS:
        if not ROLLOUT_ARROW_SCHEMA.field(name).nullable and table.column(name).null_count:
            raise ShardValidationError(f"column {name} has nulls")
    starts, lengths = group_runs(table.column("group_id"))
    check_groups(table, starts, lengths)
    models = pc.unique(table.column("model_id")).to_pylist()
    if expected_model is not None and models != [expected_model]:
        raise ShardValidationError(f"rows of model(s) {models} in the directory of model {expected_model!r}")
    correct = table.column("correct").to_numpy(zero_copy_only=False).astype(np.int64)
    reward = table.column("reward")
    scored = pc.is_valid(reward).to_numpy(zero_copy_only=False)
    values = pc.fill_null(reward, 0.0).to_numpy().astype(np.float64)
    n_scored = np.add.reduceat(scored.astype(np.int64), starts)
    reward_sum = np.add.reduceat(values * scored, starts)
    min_reward = np.minimum.reduceat(np.where(scored, values, np.inf), starts)
    max_reward = np.maximum.reduceat(np.where(scored, values, -np.inf), starts)
    created = table.column("created_at").cast(pa.int64()).to_numpy()
    none = n_scored == 0
    first = pa.array(starts)
    summary = pa.table({
        "group_id": table.column("group_id").take(first),
        "prompt_id": table.column("prompt_id").take(first),
        "dataset": table.column("dataset").take(first),
        "model_id": table.column("model_id").take(first),
        "model_revision": table.column("model_revision").take(first),
        "tokenizer_id": table.column("tokenizer_id").take(first),
        "policy_step": table.column("policy_step").take(first),
        "group_size": table.column("group_size").take(first),
        "successes": pa.array(np.add.reduceat(correct, starts).astype(np.int32)),
        "scored": pa.array(n_scored.astype(np.int32)),
        "reward_sum": pa.array(reward_sum),
        "mean_reward": pa.array(np.where(none, np.nan, reward_sum / np.maximum(n_scored, 1)), mask=none),
        "min_reward": pa.array(min_reward, mask=none),
        "max_reward": pa.array(max_reward, mask=none),
        "created_us": pa.array(np.maximum.reduceat(created, starts)),
        "row_start": pa.array(starts),
        "num_rows": pa.array(lengths.astype(np.int32)),
    })
    return summary


class StoreIndex:
    """The index of one store root; thread-safe; the only opener of `<root>/index.duckdb`."""

    def __init__(self, settings: StoreSettings):
        self.settings = settings
        self.root = Path(settings.root)
        self.path = self.root / "index.duckdb"
        self.reader = ShardReader(self.root, settings.max_open_files)
        self._write_lock = threading.RLock()  # DuckDB writes, file renames into the index, mirror updates
        self._mirror_lock = threading.Lock()
        self._compact_lock = threading.Lock()
        self._local = threading.local()
        self._by_prompt: dict[str, list[GroupRef]] = {}
        self._by_group: dict[str, GroupRef] = {}
        self._known_files: dict[str, int] = {}  # relative path -> file_id (live or retired)
        self._known_problems: set[tuple[str, str]] = set()
        self._next_file_id = 1
        self._next_seq = 1
        self.last_ingest_us: int | None = None
        self._con: duckdb.DuckDBPyConnection | None = None

    # ------------------------------------------------------------------ opening, closing, rebuilding

    def open(self) -> StoreIndex:
        """Open (or create) the index, reconcile it with the files on disk, load the mirror, index new files."""
        self._connect()
        self._reconcile()
        self._load_mirror()
        self.ingest_new()
        self.delete_orphan_lookup_files()
        return self

    def _connect(self) -> None:
        for sub in ("rollouts", "prompts", "quarantine"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # one thread: the index's statements are small (an ingest inserts ~1000 groups; the largest query
        # aggregates one row per group), and a second thread cost the ingest ~25% more CPU in task hand-offs
        config = {"threads": 1, "memory_limit": self.settings.duckdb_memory_limit}
        try:
            self._con = duckdb.connect(str(self.path), config=config)
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise IndexLocked(
                    f"{self.path} is held by another process (a running store?): {exc}. Stop it, or ask it over "
                    "HTTP (`graft-store stats --host/--port`)"
                ) from exc
            self._set_aside(f"cannot open: {exc}")
            self._con = duckdb.connect(str(self.path), config=config)
        except duckdb.Error as exc:
            self._set_aside(f"cannot open: {exc}")
            self._con = duckdb.connect(str(self.path), config=config)
        self._con.execute(SCHEMA_SQL)
        version = next(iter(self._con.execute("SELECT value FROM meta WHERE key = 'index_version'").fetchall()), None)
        if version is None:
            self._con.execute("INSERT INTO meta VALUES ('index_version', ?)", [INDEX_VERSION])
        elif version[0] != INDEX_VERSION:
            self._con.close()
            self._set_aside(f"index version {version[0]}, this store writes {INDEX_VERSION}")
            self._connect()
            return
        self._next_file_id = self._con.execute("SELECT coalesce(max(file_id), 0) + 1 FROM files").fetchall()[0][0]
        self._next_seq = self._con.execute("SELECT coalesce(max(seq), 0) + 1 FROM groups").fetchall()[0][0]

    def _set_aside(self, reason: str) -> None:
        aside = self.path.with_name(f"index.duckdb.broken-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}")
        log.error("index %s unusable (%s): moved to %s; rebuilding from the Parquet files", self.path, reason, aside)
        for suffix in ("", ".wal"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                shutil.move(src, Path(str(aside) + suffix))

    def _reconcile(self) -> None:
        """Delete shards retired before a restart; drop index entries of files that vanished."""
        con = self._con
        for file_id, rel, retired in con.execute("SELECT file_id, path, retired_us FROM files").fetchall():
            exists = (self.root / rel).exists()
            if retired is not None:
                (self.root / rel).unlink(missing_ok=True)
                self.reader.forget(rel)
                con.execute("DELETE FROM files WHERE file_id = ?", [file_id])
            elif not exists:
                self.reader.forget(rel)
                n = con.execute("SELECT count(*) FROM groups WHERE file_id = ?", [file_id]).fetchall()[0][0]
                log.warning("shard %s is in the index but gone from disk: dropping its %d groups", rel, n)
                con.execute("DELETE FROM groups WHERE file_id = ?", [file_id])
                con.execute("DELETE FROM problems WHERE file_id = ?", [file_id])
                con.execute("DELETE FROM files WHERE file_id = ?", [file_id])

    def _load_mirror(self) -> None:
        rows = self._con.execute("""
            SELECT g.group_id, g.prompt_id, g.model_id, g.policy_step, g.created_us, g.successes, g.group_size,
                   g.seq, f.path, g.row_start, g.num_rows
            FROM groups g JOIN files f USING (file_id)""").fetchall()
        by_prompt: dict[str, list[GroupRef]] = {}
        by_group: dict[str, GroupRef] = {}
        for ref in map(GroupRef._make, rows):
            by_group[ref.group_id] = ref
            by_prompt.setdefault(ref.prompt_id, []).append(ref)
        for refs in by_prompt.values():
            refs.sort(key=GroupRef.recency_key)
        with self._mirror_lock:
            self._by_prompt, self._by_group = by_prompt, by_group
        self._known_files = dict((p, i) for i, p in self._con.execute("SELECT file_id, path FROM files").fetchall())
        self._known_problems = set(self._con.execute("SELECT dataset, prompt_id FROM problems").fetchall())
        last = self._con.execute("SELECT max(indexed_us) FROM files").fetchall()[0][0]
        self.last_ingest_us = last

    def close(self) -> None:
        with self._write_lock:
            if self._con is not None:
                self._con.execute("CHECKPOINT")
                self._con.close()
                self._con = None

    def rebuild(self) -> int:
        """Recreate the index from the Parquet files alone; return the number of groups indexed."""
        with self._write_lock:
            if self._con is None:
                self._connect()  # takes DuckDB's file lock, or raises IndexLocked: never rebuild under a server
            self._con.execute("DROP TABLE IF EXISTS groups; DROP TABLE IF EXISTS files; "
                              "DROP TABLE IF EXISTS duplicates; DROP TABLE IF EXISTS problems; DROP TABLE IF EXISTS meta")
            self._con.execute(SCHEMA_SQL)
            self._con.execute("INSERT INTO meta VALUES ('index_version', ?)", [INDEX_VERSION])
            self._next_file_id = self._next_seq = 1
            self._local = threading.local()
            self._load_mirror()
            self.ingest_new()
            return len(self._by_group)

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB cursor for reads on this thread (cursors are cheap connections to the same database)."""
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self._con.cursor()
            self._local.cursor = cursor
        return cursor

    # ------------------------------------------------------------------ ingest

    def scan(self) -> list[Path]:
        """Final-named shards and problem files not yet in the index, oldest name first."""
        found = []
        stale_before = time.time() - self.settings.tmp_max_age_s
        for kind, prefix in (("rollouts", "model="), ("prompts", "dataset=")):
            base = self.root / kind
            if not base.is_dir():
                continue
            for sub in os.scandir(base):
                if not (sub.name.startswith(prefix) and sub.is_dir()):
                    continue
                for entry in os.scandir(sub.path):
                    name = entry.name
                    if name.startswith("part-") and name.endswith(".parquet"):
                        rel = f"{kind}/{sub.name}/{name}"
                        if rel not in self._known_files:
                            found.append(self.root / rel)
                    elif name.startswith(TMP_PREFIX):
                        self._remove_stale_tmp(Path(entry.path), stale_before)
        return sorted(found, key=lambda p: p.name)

    def delete_orphan_lookup_files(self) -> int:
        """Delete lookup files whose shard is neither on disk nor indexed, and temporary ones, once older than
        tmp_max_age_s: a writer that died between its lookup file and its shard leaves them behind."""
        base = self.root / LOOKUP_DIR
        if not base.is_dir():
            return 0
        stale_before = time.time() - self.settings.tmp_max_age_s
        deleted = 0
        for sub in os.scandir(base):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                shard = f"rollouts/{sub.name}/{entry.name.removesuffix(LOOKUP_SUFFIX)}.parquet"
                in_use = shard in self._known_files or (self.root / shard).exists()
                if in_use and not entry.name.startswith(TMP_PREFIX):
                    continue
                try:
                    if entry.stat().st_mtime < stale_before:
                        os.unlink(entry.path)
                        deleted += 1
                except FileNotFoundError:
                    pass
        return deleted

    def open_lookup_files(self) -> None:
        """Open every live shard's lookup file, rebuilding missing ones: after an upgrade or a deleted lookup/
        directory, lookups would otherwise pay for the rebuilds (~0.1 s per 8192 rollouts) one file at a time."""
        rows = self._cursor().execute(
            "SELECT path FROM files WHERE kind = 'rollouts' AND retired_us IS NULL ORDER BY path").fetchall()
        for (rel,) in rows:
            try:
                self.reader.open(rel)
            except OSError as exc:  # ShardReadError included: the lookup that meets it quarantines the shard
                log.warning("cannot open or rebuild the lookup file of %s: %s", rel, exc)

    def _remove_stale_tmp(self, path: Path, stale_before: float) -> None:
        try:
            if path.stat().st_mtime < stale_before:
                path.unlink()
                log.warning("removed %s: a writer's temporary file untouched for %.0f s (the writer died)",
                            path, self.settings.tmp_max_age_s)
        except FileNotFoundError:
            pass

    def ingest_new(self) -> int:
        """Index every new file on disk; return the number of groups indexed."""
        total = 0
        for path in self.scan():
            if path.parent.parent.name == "prompts":
                self.ingest_problem_file(path)
            else:
                total += self.ingest_file(path)
        return total

    def ingest_file(self, path: Path) -> int:
        """Index one rollout shard (idempotent); quarantine it if unreadable. Return groups indexed."""
        rel = path.relative_to(self.root).as_posix()
        if rel in self._known_files:
            return 0
        try:
            stat = path.stat()
        except FileNotFoundError:
            return 0
        expected_model = path.parent.name.removeprefix("model=")
        try:
            summary = summarise_shard(path, expected_model)
            # normally the writer's lookup file, checked against the groups; rebuilt from the shard if not
            self.reader.check(rel, summary.column("row_start").to_numpy(), summary.column("num_rows").to_numpy())
        except (ShardReadError, ShardValidationError) as exc:
            self.quarantine(rel, str(exc))
            return 0
        with self._write_lock:
            if rel in self._known_files:
                return 0
            group_ids = summary.column("group_id").to_pylist()
            duplicate = np.fromiter((g in self._by_group for g in group_ids), bool, len(group_ids))
            fresh = summary.filter(pa.array(~duplicate))
            file_id = self._next_file_id
            first_seq = self._next_seq
            indexed = now_us()
            fresh = fresh.append_column("seq", pa.array(np.arange(first_seq, first_seq + fresh.num_rows, dtype=np.int64)))
            fresh = fresh.append_column("file_id", pa.array(np.full(fresh.num_rows, file_id, np.int32)))
            fresh = fresh.append_column("indexed_us", pa.array(np.full(fresh.num_rows, indexed, np.int64)))
            duplicate_ids = [g for g, d in zip(group_ids, duplicate) if d]
            con = self._con
            con.begin()
            try:
                con.execute(
                    "INSERT INTO files VALUES (?, ?, 'rollouts', ?, ?, ?, ?, ?, ?, ?, NULL)",
                    [file_id, rel, expected_model, int(summary.column("num_rows").to_numpy().sum()), stat.st_size,
                     int(stat.st_mtime * 1e6), indexed, fresh.num_rows, len(duplicate_ids)],
                )
                if fresh.num_rows:
                    con.register("fresh_groups", fresh)
                    con.execute("""
                        INSERT INTO groups SELECT group_id, seq, prompt_id, dataset, model_id, model_revision,
                            tokenizer_id, policy_step, group_size, successes, scored, reward_sum, mean_reward,
                            min_reward, max_reward, created_us, file_id, row_start, num_rows, indexed_us
                        FROM fresh_groups""")
                    con.unregister("fresh_groups")
                if duplicate_ids:
                    con.executemany("INSERT INTO duplicates VALUES (?, ?, ?)", [[g, rel, indexed] for g in duplicate_ids])
                con.commit()
            except BaseException:
                con.rollback()
                raise
            self._next_file_id += 1
            self._next_seq += fresh.num_rows
            self._known_files[rel] = file_id
            self._add_to_mirror(fresh, rel)
            self.last_ingest_us = indexed
        if duplicate_ids:
            log.warning("shard %s: %d of %d groups already indexed, kept the first copy and skipped these "
                        "(first few: %s)", rel, len(duplicate_ids), len(group_ids), ", ".join(duplicate_ids[:5]))
        log.debug("indexed %s: %d groups", rel, fresh.num_rows)
        return fresh.num_rows

    def _add_to_mirror(self, fresh: pa.Table, rel: str) -> None:
        columns = [fresh.column(name).to_pylist() for name in (
            "group_id", "prompt_id", "model_id", "policy_step", "created_us", "successes", "group_size", "seq")]
        locations = [fresh.column("row_start").to_pylist(), fresh.column("num_rows").to_pylist()]
        refs = list(map(GroupRef._make, zip(*columns, itertools.repeat(rel), *locations)))
        with self._mirror_lock:
            for ref in refs:
                self._by_group[ref.group_id] = ref
                # a prompt's list stays sorted most recent first; insort compares ~log2(n) keys, sort ~n
                bisect.insort(self._by_prompt.setdefault(ref.prompt_id, []), ref, key=GroupRef.recency_key)

    def ingest_problem_file(self, path: Path) -> int:
        """Index a problems file of one dataset: (dataset, prompt id) pairs, first copy wins."""
        rel = path.relative_to(self.root).as_posix()
        if rel in self._known_files:
            return 0
        try:
            parquet = pq.ParquetFile(path)
            if parquet.schema_arrow.names != PROBLEM_ARROW_SCHEMA.names:
                raise ShardValidationError(f"columns {parquet.schema_arrow.names}, expected {PROBLEM_ARROW_SCHEMA.names}")
            table = parquet.read(columns=["dataset", "prompt_id"])
            stat = path.stat()
        except (OSError, pa.ArrowException, ShardValidationError) as exc:
            self.quarantine(rel, str(exc))
            return 0
        with self._write_lock:
            if rel in self._known_files:
                return 0
            pairs = [(d, p) for d, p in zip(*(c.to_pylist() for c in table.columns))]
            fresh = list(dict.fromkeys(pair for pair in pairs if pair not in self._known_problems))
            file_id = self._next_file_id
            con = self._con
            con.begin()
            try:
                con.execute(
                    "INSERT INTO files VALUES (?, ?, 'prompts', NULL, ?, ?, ?, ?, ?, ?, NULL)",
                    [file_id, rel, table.num_rows, stat.st_size, int(stat.st_mtime * 1e6), now_us(), len(fresh),
                     len(pairs) - len(fresh)],
                )
                if fresh:
                    con.executemany("INSERT INTO problems VALUES (?, ?, ?)", [[d, p, file_id] for d, p in fresh])
                con.commit()
            except BaseException:
                con.rollback()
                raise
            self._next_file_id += 1
            self._known_files[rel] = file_id
            self._known_problems.update(fresh)
        return len(fresh)

    def quarantine(self, rel: str, reason: str) -> None:
        """Move a bad file to <root>/quarantine/ (with a .reason.txt), drop whatever the index had of it."""
        source = self.root / rel
        target = self.root / "quarantine" / f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{rel.replace('/', '__')}"
        with self._write_lock:
            file_id = self._known_files.pop(rel, None)
            if file_id is not None:
                con = self._con
                con.begin()
                try:
                    con.execute("DELETE FROM groups WHERE file_id = ?", [file_id])
                    con.execute("DELETE FROM problems WHERE file_id = ?", [file_id])
                    con.execute("DELETE FROM files WHERE file_id = ?", [file_id])
                    con.commit()
                except BaseException:
                    con.rollback()
                    raise
                with self._mirror_lock:
                    for gid in [g for g, ref in self._by_group.items() if ref.file == rel]:
                        ref = self._by_group.pop(gid)
                        self._by_prompt[ref.prompt_id].remove(ref)
                        if not self._by_prompt[ref.prompt_id]:
                            del self._by_prompt[ref.prompt_id]
            self.reader.forget(rel)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(source, target)
                target.with_name(target.name + ".reason.txt").write_text(reason + "\n")
            except FileNotFoundError:
                log.warning("shard %s unreadable (%s) and already gone", rel, reason)
                return
        log.error("quarantined %s -> %s: %s", rel, target.relative_to(self.root), reason)

    # ------------------------------------------------------------------ push ingest

    def push(self, table: pa.Table, problems: list[Problem]) -> tuple[int, list[str], str | None]:
        """Write validated groups of one model as a shard and index it at once.

        Returns (groups accepted, duplicate group ids not written, shard path relative to the root).
        """
        with self._write_lock:
            group_ids = pc.unique(table.column("group_id")).to_pylist()
            duplicates = [g for g in group_ids if g in self._by_group]
            if duplicates:
                table = table.filter(pc.invert(pc.is_in(table.column("group_id"), pa.array(duplicates))))
            new_problems = [p for p in problems if (p.dataset, p.prompt_id) not in self._known_problems]
            if new_problems:
                for path in write_problems(self.root, new_problems):
                    self.ingest_problem_file(path)
            if table.num_rows == 0:
                return 0, duplicates, None
            model = table.column("model_id")[0].as_py()
            path = write_rollout_table(model_dir(self.root, model), table)
            accepted = self.ingest_file(path)
            return accepted, duplicates, path.relative_to(self.root).as_posix()

    # ------------------------------------------------------------------ lookups

    def select_peer_groups(self, req: PeerLookupRequest) -> tuple[list[GroupRef], list[str]]:
        """The groups a peer lookup returns (by prompt in request order, most recent first) and the misses."""
        peers = set(req.peer_models) if req.peer_models else None
        oldest_us = None if req.max_age_s is None else now_us() - req.max_age_s * 1e6  # float: max_age_s may be huge
        chosen: list[GroupRef] = []
        misses: list[str] = []
        with self._mirror_lock:
            for prompt in dict.fromkeys(req.prompt_ids):
                found = 0
                for ref in self._by_prompt.get(prompt, ()):
                    if ref.model_id == req.learner_model or (peers is not None and ref.model_id not in peers):
                        continue
                    if req.informative_only and not 0 < ref.successes < ref.group_size:
                        continue
                    if ref.successes < req.min_successes:
                        continue
                    if req.min_policy_step is not None and ref.policy_step < req.min_policy_step:
                        continue
                    if oldest_us is not None and ref.created_us < oldest_us:
                        continue
                    chosen.append(ref)
                    found += 1
                    if found == req.groups_per_prompt:
                        break
                if not found:
                    misses.append(prompt)
        return chosen, misses

    def select_prompt_groups(self, prompt: str, model: str | None, limit: int) -> list[GroupRef]:
        with self._mirror_lock:
            refs = [r for r in self._by_prompt.get(prompt, ()) if model is None or r.model_id == model]
        return refs[:limit]

    def select_group(self, group_id: str) -> list[GroupRef]:
        with self._mirror_lock:
            ref = self._by_group.get(group_id)
        return [] if ref is None else [ref]

    def read_selected(self, select, as_messages: bool = False):
        """Run `select() -> (refs, extra)` and read the refs' rows; on an unreadable shard, quarantine or
        re-resolve (a compacted-away file) and select again. Returns (table, extra), or with `as_messages`
        (one IPC record batch message per group, extra) for `arrow_stream`."""
        read = self.reader.messages if as_messages else self.reader.read
        failed: set[str] = set()
        for attempt in range(5):
            refs, extra = select()
            try:
                return read([(r.file, r.row_start, r.num_rows) for r in refs]), extra
            except ShardReadError as exc:
                if attempt == 4:
                    raise
                rel = exc.path.relative_to(self.root).as_posix()
                if self._is_retired(rel) or not exc.path.exists():
                    continue  # compacted away meanwhile: the next select() finds the groups' new home
                if rel in failed:  # failed twice from a freshly opened file: really damaged
                    self.quarantine(rel, f"unreadable at lookup: {exc.reason}")
                failed.add(rel)
        raise AssertionError("unreachable")

    def _is_retired(self, rel: str) -> bool:
        rows = self._cursor().execute("SELECT retired_us FROM files WHERE path = ?", [rel]).fetchall()
        return not rows or rows[0][0] is not None

    def group_count(self) -> int:
        return len(self._by_group)

    def known_group(self, group_id: str) -> bool:
        return group_id in self._by_group

    # ------------------------------------------------------------------ filtered pages (DuckDB)

    def rollout_page(
        self, *, model: str | None = None, prompt_id: str | None = None, dataset: str | None = None,
        correct: bool | None = None, min_reward: float | None = None, max_reward: float | None = None,
        min_policy_step: int | None = None, max_policy_step: int | None = None,
        cursor: str | None = None, limit: int = 100,
    ) -> tuple[pa.Table, str | None]:
        """Rollouts matching the filters in ingest order, `limit` at most, and the cursor of the next page."""
        seq, row = decode_cursor(cursor) if cursor else (0, 0)
        where, params = ["g.seq >= ?"], [seq]
        for clause, value in (("g.model_id = ?", model), ("g.prompt_id = ?", prompt_id), ("g.dataset = ?", dataset),
                              ("g.policy_step >= ?", min_policy_step), ("g.policy_step <= ?", max_policy_step),
                              ("g.max_reward >= ?", min_reward), ("g.min_reward <= ?", max_reward)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if correct is True:
            where.append("g.successes > 0")
        elif correct is False:
            where.append("g.successes < g.group_size")
        sql = f"""SELECT g.seq, f.path, g.row_start, g.num_rows FROM groups g JOIN files f USING (file_id)
                  WHERE {' AND '.join(where)} ORDER BY g.seq LIMIT ?"""
        pieces: list[pa.Table] = []
        taken = scanned = 0
        batch = max(16, min(256, limit // 4 + 1))
        while True:
            def select():
                rows = self._cursor().execute(sql, params + [batch]).fetchall()
                return [GroupRef("", "", "", 0, 0, 0, 0, s, f, r, n) for s, f, r, n in rows], rows

            table, rows = self.read_selected(select)
            if not rows:
                return _concat(pieces), None
            seqs = np.repeat([r[0] for r in rows], [r[3] for r in rows])  # (rows read,)
            position = np.concatenate([np.arange(r[3]) for r in rows])  # row within its group
            keep = (seqs > seq) | (position >= row)
            if correct is not None:
                keep &= table.column("correct").to_numpy(zero_copy_only=False) == correct
            if min_reward is not None or max_reward is not None:
                reward = table.column("reward")
                ok = pc.is_valid(reward).to_numpy(zero_copy_only=False)
                values = pc.fill_null(reward, 0.0).to_numpy()
                if min_reward is not None:
                    ok &= values >= min_reward
                if max_reward is not None:
                    ok &= values <= max_reward
                keep &= ok
            kept = np.flatnonzero(keep)
            if taken + len(kept) >= limit:
                kept = kept[: limit - taken]
                pieces.append(table.take(pa.array(kept)))
                last = int(kept[-1])
                return _concat(pieces), encode_cursor(int(seqs[last]), int(position[last]) + 1)
            pieces.append(table.take(pa.array(kept)))
            taken += len(kept)
            scanned += len(rows)
            seq, row = rows[-1][0] + 1, 0
            params[0] = seq
            if scanned >= self.settings.max_scan_groups:
                return _concat(pieces), encode_cursor(seq, 0)

    # ------------------------------------------------------------------ stats

    def stats(self) -> StatsResponse:
        cursor = self._cursor()
        rows = cursor.execute("""
            SELECT model_id, count(*), sum(num_rows), count(DISTINCT prompt_id),
                   sum(reward_sum) / nullif(sum(scored), 0),
                   count(*) FILTER (WHERE successes > 0 AND successes < group_size),
                   max(policy_step), max(created_us)
            FROM groups GROUP BY model_id ORDER BY model_id""").fetchall()
        models = [
            ModelStats(model_id=m, groups=g, rollouts=int(r), prompts=p, success_rate=s, informative_groups=i,
                       max_policy_step=step, newest_created_at=us_to_datetime(c))
            for m, g, r, p, s, i, step, c in rows
        ]
        files = cursor.execute(
            "SELECT count(*) FROM files WHERE kind = 'rollouts' AND retired_us IS NULL").fetchall()[0][0]
        duplicates = cursor.execute("SELECT count(*) FROM duplicates").fetchall()[0][0]
        quarantined = sum(1 for p in (self.root / "quarantine").iterdir() if not p.name.endswith(".reason.txt"))
        return StatsResponse(
            models=models, files=files, quarantined_files=quarantined,
            total_groups=sum(m.groups for m in models), total_rollouts=sum(m.rollouts for m in models),
            last_ingest_at=us_to_datetime(self.last_ingest_us), duplicate_groups=duplicates,
        )

    # ------------------------------------------------------------------ compaction

    def compact(self, model_id: str | None = None, min_files: int | None = None) -> dict[str, int]:
        """Merge small shards of each model into files sorted by prompt id; swap them in atomically.

        Returns counts: files_merged, files_written, groups_moved, files_retired_empty.
        """
        min_files = self.settings.compact_min_files if min_files is None else min_files
        report = {"files_merged": 0, "files_written": 0, "groups_moved": 0, "files_retired_empty": 0}
        with self._compact_lock:
            candidates = self._cursor().execute("""
                SELECT f.file_id, f.path, f.model_id, coalesce(live.rows, 0) AS live_rows
                FROM files f LEFT JOIN (SELECT file_id, sum(num_rows) AS rows FROM groups GROUP BY file_id) live
                    USING (file_id)
                WHERE f.kind = 'rollouts' AND f.retired_us IS NULL AND coalesce(live.rows, 0) < ?
                    AND (? IS NULL OR f.model_id = ?)
                ORDER BY f.model_id, f.path""", [self.settings.compact_small_rows, model_id, model_id]).fetchall()
            by_model: dict[str, list[tuple[int, str, int]]] = {}
            for file_id, rel, model, live_rows in candidates:
                if live_rows == 0:
                    self._retire([file_id])
                    report["files_retired_empty"] += 1
                else:
                    by_model.setdefault(model, []).append((file_id, rel, live_rows))
            for model, files in by_model.items():
                if len(files) < min_files:
                    continue
                batch: list[tuple[int, str, int]] = []
                rows = 0
                for item in files + [None]:
                    if item is not None and (not batch or rows + item[2] <= self.settings.compact_target_rows):
                        batch.append(item)
                        rows += item[2]
                        continue
                    if len(batch) >= 2:
                        moved = self._compact_batch(model, [b[0] for b in batch])
                        if moved:
                            report["files_merged"] += len(batch)
                            report["files_written"] += 1
                            report["groups_moved"] += moved
                    batch, rows = ([item], item[2]) if item is not None else ([], 0)
        return report

    def _compact_batch(self, model: str, file_ids: list[int]) -> int:
        placeholders = ", ".join("?" * len(file_ids))
        rows = self._cursor().execute(f"""
            SELECT g.group_id, f.path, g.row_start, g.num_rows FROM groups g JOIN files f USING (file_id)
            WHERE g.file_id IN ({placeholders}) ORDER BY f.path, g.row_start""", file_ids).fetchall()
        if not rows:
            return 0
        table = self.reader.read([(path, start, n) for _, path, start, n in rows])
        order = pc.sort_indices(
            table.select(["prompt_id", "group_id"]).append_column("position", pa.array(np.arange(table.num_rows))),
            sort_keys=[("prompt_id", "ascending"), ("group_id", "ascending"), ("position", "ascending")],
        )
        table = table.take(order)
        starts, lengths = group_runs(table.column("group_id"))
        tmp = write_rollout_table(model_dir(self.root, model), table, ROW_GROUP_ROWS, publish_now=False)
        moved_ids = table.column("group_id").take(pa.array(starts)).to_pylist()
        with self._write_lock:
            live = self._con.execute(
                f"SELECT count(*) FROM groups WHERE file_id IN ({placeholders})", file_ids).fetchall()[0][0]
            if live != len(rows):  # a shard of the batch was quarantined meanwhile: try again next time
                discard(tmp)
                return 0
            final = publish(tmp)
            rel = final.relative_to(self.root).as_posix()
            file_id = self._next_file_id
            stamp = now_us()
            locations = pa.table({"group_id": moved_ids, "row_start": pa.array(starts)})
            con = self._con
            con.begin()
            try:
                con.execute(
                    "INSERT INTO files VALUES (?, ?, 'rollouts', ?, ?, ?, ?, ?, ?, 0, NULL)",
                    [file_id, rel, model, table.num_rows, final.stat().st_size, stamp, stamp, len(moved_ids)],
                )
                con.register("new_locations", locations)
                con.execute("""UPDATE groups SET file_id = ?, row_start = n.row_start
                               FROM new_locations n WHERE groups.group_id = n.group_id""", [file_id])
                con.unregister("new_locations")
                con.execute(f"UPDATE files SET retired_us = ? WHERE file_id IN ({placeholders})", [stamp, *file_ids])
                con.commit()
            except BaseException:
                con.rollback()
                discard(final)
                raise
            self._next_file_id += 1
            self._known_files[rel] = file_id
            with self._mirror_lock:
                for gid, start in zip(moved_ids, starts.tolist()):
                    old = self._by_group[gid]
                    new = GroupRef(old.group_id, old.prompt_id, old.model_id, old.policy_step, old.created_us,
                                   old.successes, old.group_size, old.seq, rel, start, old.num_rows)
                    self._by_group[gid] = new
                    refs = self._by_prompt[old.prompt_id]
                    refs[refs.index(old)] = new
        log.info("compacted %d shards of %s into %s (%d groups, %d rows)", len(file_ids), model, rel,
                 len(moved_ids), table.num_rows)
        return len(moved_ids)

    def _retire(self, file_ids: list[int]) -> None:
        with self._write_lock:
            placeholders = ", ".join("?" * len(file_ids))
            self._con.execute(f"UPDATE files SET retired_us = ? WHERE file_id IN ({placeholders})", [now_us(), *file_ids])

    def delete_retired(self, grace_s: float | None = None) -> int:
        """Delete shards retired more than `grace_s` ago (in-flight reads of them have finished)."""
        grace_s = self.settings.retired_grace_s if grace_s is None else grace_s
        with self._write_lock:
            rows = self._con.execute("SELECT file_id, path FROM files WHERE retired_us <= ?",
                                     [now_us() - int(grace_s * 1e6)]).fetchall()
            for file_id, rel in rows:
                self.reader.forget(rel)
                (self.root / rel).unlink(missing_ok=True)
                self._con.execute("DELETE FROM files WHERE file_id = ?", [file_id])
                self._known_files.pop(rel, None)
        return len(rows)


def _concat(pieces: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(pieces) if pieces else ROLLOUT_ARROW_SCHEMA.empty_table()
