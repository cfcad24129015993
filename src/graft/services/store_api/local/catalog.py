"""The index's DuckDB tables (files, groups, duplicates, problems) and their lifecycle: the part of `StoreIndex`
the other parts (ingest, queries, compaction) work through.

Only the store process opens `<root>/index.duckdb` (DuckDB takes a file lock). `Catalog` owns the connection
and its write lock, the schema, connecting (setting aside an unusable or other-version index), reconciling the
tables with the files on disk, the mirror (`mirror.py`) and the paths of the indexed files, the next file id and
seq, per-thread read cursors, quarantine, the readers' manifest (`manifest.py`) and closing. The other parts
change the tables through `transaction()` and `execute()`, and tell the catalog what they added (`add_file`).
Every change commits to DuckDB first and then applies to the mirror and the manifest, under `write_lock`.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from graft.schemas import MU_FIELDS, mu_is_behaviour
from graft.services.store_api.local.lookup import ShardReader
from graft.services.store_api.local.manifest import write_manifest
from graft.services.store_api.local.mirror import GroupMirror, GroupRef
from graft.services.store_api.settings import StoreSettings

log = logging.getLogger("graft.store")

# 2: every shard passes validate_table at ingest, duplicates tell conflicts apart (an index of version 1 is set
# aside and rebuilt from the files, so shards indexed under the old rules are checked again)
# 3: groups.has_mu (rows without behaviour logprobs, schema version 2). An index of version 2 gains the column in
# place, true for every group: it indexed only rows checked under rules that required behaviour logprobs
# 4: groups.has_mu is schemas.mu_is_behaviour of the group's first row (a 'raw' group away from temperature 1 has
# logprobs that are not mu). An index of version 2 or 3 has it recomputed in place from its shards' columns
INDEX_VERSION = "4"

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
    indexed_us BIGINT NOT NULL,
    has_mu BOOLEAN NOT NULL DEFAULT true  -- its logprobs are its behaviour mu (schemas.mu_is_behaviour)
);
CREATE TABLE IF NOT EXISTS duplicates (
    group_id VARCHAR NOT NULL, path VARCHAR NOT NULL, seen_us BIGINT NOT NULL,
    conflict BOOLEAN NOT NULL          -- stored under another model or prompt, not a second copy of the group
);
CREATE TABLE IF NOT EXISTS problems (
    dataset VARCHAR NOT NULL, prompt_id VARCHAR NOT NULL, file_id INTEGER NOT NULL, PRIMARY KEY (dataset, prompt_id)
);
"""


class IndexLocked(RuntimeError):
    """Another process holds the index (a running store)."""


class Catalog:
    """The DuckDB index of one store root and its mirror: the part of `StoreIndex` (index.py) that owns the
    connection; the other parts hold it and call its methods."""

    def __init__(self, settings: StoreSettings):
        self.settings = settings
        self.root = Path(settings.root)
        self.path = self.root / "index.duckdb"
        self.reader = ShardReader(self.root, settings.max_open_files)
        self.write_lock = threading.RLock()  # DuckDB writes, file renames into the index, mirror updates
        self._local = threading.local()
        self.mirror = GroupMirror()
        self._known_files: dict[str, int] = {}  # relative path -> file_id (live or retired)
        self._next_file_id = 1
        self._next_seq = 1
        self.last_ingest_us: int | None = None
        self._con: duckdb.DuckDBPyConnection | None = None

    # ------------------------------------------------------------------ opening, closing, rebuilding

    def connect(self) -> None:
        """Open (or create) `<root>/index.duckdb`; IndexLocked when another process holds it."""
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
        elif version[0] in ("2", "3"):  # has_mu absent, or "carries logprobs" (see INDEX_VERSION)
            if version[0] == "2":
                self._con.execute("ALTER TABLE groups ADD COLUMN has_mu BOOLEAN DEFAULT true")
            try:
                self._recompute_has_mu()
            except (OSError, pa.ArrowException, duckdb.Error) as exc:
                self._con.close()
                self._set_aside(f"index version {version[0]}: has_mu not recomputable ({exc})")
                self.connect()
                return
            self._con.execute("UPDATE meta SET value = ? WHERE key = 'index_version'", [INDEX_VERSION])
        elif version[0] != INDEX_VERSION:
            self._con.close()
            self._set_aside(f"index version {version[0]}, this store writes {INDEX_VERSION}")
            self.connect()
            return
        self._next_file_id = self._con.execute("SELECT coalesce(max(file_id), 0) + 1 FROM files").fetchall()[0][0]
        self._next_seq = self._con.execute("SELECT coalesce(max(seq), 0) + 1 FROM groups").fetchall()[0][0]

    def _recompute_has_mu(self) -> None:
        """has_mu of every indexed group from its first row's mode and sampling (`mu_is_behaviour`), reading those four
        columns of each live shard: an index written under an older meaning of has_mu is kept, not rebuilt."""
        located = self._con.execute("""
            SELECT f.path, list(g.group_id ORDER BY g.row_start), list(g.row_start ORDER BY g.row_start)
            FROM groups g JOIN files f USING (file_id) WHERE f.retired_us IS NULL GROUP BY f.path""").fetchall()
        without = []
        for rel, group_ids, starts in located:
            if not (self.root / rel).exists():
                continue  # reconcile() drops its groups
            firsts = pq.read_table(self.root / rel, columns=list(MU_FIELDS)).take(pa.array(starts)).to_pylist()
            without += [group_id for group_id, row in zip(group_ids, firsts, strict=True) if not mu_is_behaviour(row)]
        self._con.execute("UPDATE groups SET has_mu = true")
        if without:
            self._con.execute("UPDATE groups SET has_mu = false WHERE group_id IN (SELECT unnest(?))", [without])
        log.info("index version 4: has_mu recomputed for %d shards, %d groups without mu", len(located), len(without))

    def _set_aside(self, reason: str) -> None:
        aside = self.path.with_name(f"index.duckdb.broken-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}")
        log.error("index %s unusable (%s): moved to %s; rebuilding from the Parquet files", self.path, reason, aside)
        for suffix in ("", ".wal"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                shutil.move(src, Path(str(aside) + suffix))

    def reconcile(self) -> None:
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

    def load_mirror(self) -> None:
        """Load the mirror and the paths of the indexed files from the tables."""
        rows = self._con.execute("""
            SELECT g.group_id, g.prompt_id, g.model_id, g.policy_step, g.created_us, g.successes, g.group_size,
                   g.seq, f.path, g.row_start, g.num_rows, g.has_mu
            FROM groups g JOIN files f USING (file_id)""").fetchall()
        self.mirror.replace(map(GroupRef._make, rows))
        self._known_files = dict((p, i) for i, p in self._con.execute("SELECT file_id, path FROM files").fetchall())
        last = self._con.execute("SELECT max(indexed_us) FROM files").fetchall()[0][0]
        self.last_ingest_us = last

    def close(self) -> None:
        with self.write_lock:
            if self._con is not None:
                self._con.execute("CHECKPOINT")
                self._con.close()
                self._con = None

    def recreate(self) -> None:
        """Drop every table and start an empty index (`StoreIndex.rebuild` then ingests the files anew)."""
        if self._con is None:
            self.connect()  # takes DuckDB's file lock, or raises IndexLocked: never rebuild under a server
        self._con.execute("DROP TABLE IF EXISTS groups; DROP TABLE IF EXISTS files; "
                          "DROP TABLE IF EXISTS duplicates; DROP TABLE IF EXISTS problems; DROP TABLE IF EXISTS meta")
        self._con.execute(SCHEMA_SQL)
        self._con.execute("INSERT INTO meta VALUES ('index_version', ?)", [INDEX_VERSION])
        self._next_file_id = self._next_seq = 1
        self._local = threading.local()
        self.load_mirror()

    def clear_files(self) -> None:
        """Empty the store root: no shards, lookup files, problems or index entries. Opens the index first if it
        is not open (its file lock, or IndexLocked)."""
        with self.write_lock:
            if self._con is None:
                self.connect()
            self.reader = ShardReader(self.root, self.settings.max_open_files)  # drops the open lookup files
            for sub in ("rollouts", "prompts", "lookup"):
                shutil.rmtree(self.root / sub, ignore_errors=True)
            self.recreate()
            for sub in ("rollouts", "prompts", "quarantine"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ what the other parts change through

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The write connection in one DuckDB transaction, under the write lock: committed when the block ends,
        rolled back if it raises."""
        with self.write_lock:
            con = self._con
            con.begin()
            try:
                yield con
                con.commit()
            except BaseException:
                con.rollback()
                raise

    def execute(self, sql: str, params: list | None = None) -> list[tuple]:
        """One statement on the write connection, under the write lock; its rows."""
        with self.write_lock:
            return self._con.execute(sql, params or []).fetchall()

    def knows(self, rel: str) -> bool:
        """Whether a file (relative to the root) is in the index, live or retired."""
        return rel in self._known_files

    @property
    def next_file_id(self) -> int:
        """The id the next file added gets (read it under the write lock, then `add_file`)."""
        return self._next_file_id

    @property
    def next_seq(self) -> int:
        """The seq the next indexed group gets (every group's is below it)."""
        return self._next_seq

    def add_file(self, rel: str, file_id: int, groups: int = 0) -> None:
        """Record a file a committed transaction added as `next_file_id`, with `groups` new groups numbered from
        `next_seq` (the mirror is the caller's to update)."""
        with self.write_lock:
            self._next_file_id += 1
            self._next_seq += groups
            self._known_files[rel] = file_id

    def forget_file(self, rel: str) -> None:
        """Drop a file deleted from the files table (a retired shard deleted)."""
        with self.write_lock:
            self._known_files.pop(rel, None)

    def meta(self, prefix: str) -> dict[str, str]:
        """The index's meta entries whose keys start with `prefix` (a lake replica keeps what it followed there)."""
        rows = self.cursor().execute("SELECT key, value FROM meta WHERE starts_with(key, ?)", [prefix]).fetchall()
        return dict(rows)

    def set_meta(self, key: str, value: str) -> None:
        with self.write_lock:
            self._con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", [key, value])

    def record_duplicates(self, copies: list[tuple[str, str, int, bool]]) -> None:
        """Record copies of stored groups met outside a shard, (group id, where, when seen in us since the epoch,
        under another model or prompt), shown in /v1/stats; a copy recorded already (the same group and where)
        is not added again."""
        with self.write_lock:
            self._con.executemany("""
                INSERT INTO duplicates SELECT $1, $2, $3, $4
                WHERE NOT EXISTS (SELECT 1 FROM duplicates WHERE group_id = $1 AND path = $2)""", [list(c) for c in copies])

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A DuckDB cursor for reads on this thread (cursors are cheap connections to the same database)."""
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = self._con.cursor()
            self._local.cursor = cursor
        return cursor

    def write_manifest(self) -> None:
        """Rewrite <root>/manifest.json, the live files for outside readers, from the index."""
        with self.write_lock:
            files = self._con.execute(
                "SELECT kind, path FROM files WHERE retired_us IS NULL ORDER BY kind, path").fetchall()
            write_manifest(self.root, [p for kind, p in files if kind == "rollouts"],
                           [p for kind, p in files if kind == "prompts"], groups=len(self.mirror))

    def quarantine(self, rel: str, reason: str) -> None:
        """Move a bad file or folder to <root>/quarantine/ (with a .reason.txt), drop whatever the index had of it."""
        source = self.root / rel
        target = self.root / "quarantine" / f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{rel.replace('/', '__')}"
        with self.write_lock:
            file_id = self._known_files.pop(rel, None)
            if file_id is not None:
                with self.transaction() as con:
                    con.execute("DELETE FROM groups WHERE file_id = ?", [file_id])
                    con.execute("DELETE FROM problems WHERE file_id = ?", [file_id])
                    con.execute("DELETE FROM files WHERE file_id = ?", [file_id])
                self.mirror.drop_file(rel)
                self.write_manifest()  # before the file leaves: readers of the manifest never miss a listed file
            if not source.is_dir():
                self.reader.forget(rel)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(source, target)
                target.with_name(target.name + ".reason.txt").write_text(reason + "\n")
            except FileNotFoundError:
                log.warning("shard %s unreadable (%s) and already gone", rel, reason)
                return
        log.error("quarantined %s -> %s: %s", rel, target.relative_to(self.root), reason)
