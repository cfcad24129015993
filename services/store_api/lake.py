"""The store's DuckLake: rollouts and problems as DuckLake tables, DuckDB's extensions from PyPI wheels.

One module of ~1000 lines because its parts share one connection discipline (`Lake._acquire`/`_release`: a
reset never closes a connection another thread uses) and one error mapping (`LakeError`/`LakeUnavailable`):
config and extensions (to `LakeConfig`, `lake_connection`), commit (`Lake.commit`, `_write_data_files`), the
reading windows (`rollouts_added`, `files_added`, `_changes`) and maintenance (`maintain`). The split by those
jobs into a `lake/` package is planned with the store's layout (issue 25).

A lake is a SQL catalog (PostgreSQL for many hosts, SQLite for one) plus Parquet data files (S3-compatible
object storage or a shared path). `rollouts` and `problems` have the columns of ROLLOUT_ARROW_SCHEMA and
PROBLEM_ARROW_SCHEMA; `rollouts` is partitioned by model_id, like the local store's directories. Plain DuckDB
reads it with `ATTACH 'ducklake:<catalog>' AS lake` (docs/lake.md).

Writers commit whole groups in one transaction: a DuckLake transaction is one snapshot, and its data files
are only referenced by the catalog once the commit lands, so a writer killed mid-commit leaves nothing
visible (at most an unreferenced file, which `maintain()` deletes). A writer encodes each model's rows as one
Parquet file itself (pyarrow, the local store's codecs: half the CPU of DuckDB's writer), puts it under the
table's path in DuckLake's partition layout (`model_id=<model>/`), and registers it in the transaction with
DuckLake's `ducklake_add_data_files`, which reads its footer for the catalog's statistics and hands the file to
DuckLake (merges and cleanup treat it as their own). DuckLake settles concurrent appends to
the same table itself (retried against the new snapshot, no data rewritten). It has no unique constraints:
a commit skips the groups the lake already holds at its snapshot (a retried commit adds nothing), refuses a
group id held under another model or prompt (`GroupConflict`, as the local store), and two writers racing
with the same group id both land. Readers keep the copy with the lowest `rowid` (DuckLake assigns row ids at
commit, in commit order, and keeps them through compaction), so every reader agrees (`first_copies`); a
replica counts the others in its stats.

Readers follow the lake by snapshot: `rollouts_between(after, upto)` returns the rows committed in
snapshots after..upto. When the catalog says those snapshots only added data files that are still as they
were added (`files_added`: the usual case, writers' commits), the files are fetched and decoded as they are,
row ids from the catalog (DuckLake's spec: a file's rows are numbered from its `row_id_start`); otherwise
(merges, deletes, inlined rows, expired snapshots) DuckLake's change feed reads them (the `snapshot_id`
virtual column, which prunes data files by the snapshot that added them and survives merges and expiry).

No extension is downloaded at run time: DuckDB is pinned to the version whose extensions are published as
PyPI wheels (the `lake` extra), `duckdb_extensions.import_extension` installs each from its wheel, then it
is loaded by name, with DuckDB's auto-install and auto-load off.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Container, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA, Problem
from services.store_api.durable import fsync_directory
from services.store_api.mirror import GroupConflict, GroupRef
from services.store_api.shards import COMPRESSION
from services.store_api.tables import SMALL_COLUMNS_SCHEMA, group_runs
from services.store_api.targets import LAKE_PREFIX

log = logging.getLogger("graft.store.lake")

PINNED_DUCKDB = "1.5.5"
# module name of duckdb_extensions' wheel -> the name the extension loads as
EXTENSIONS = {"ducklake": "ducklake", "httpfs": "httpfs", "postgres": "postgres_scanner", "sqlite": "sqlite_scanner"}
ALIAS = "lake"  # the lake's name inside each DuckDB connection
LAYOUT_COMMENT = "graft rollouts, layout 1"  # on the rollouts table: a lake this store made, in this layout
NO_PROGRESS_BAR = "SET enable_progress_bar = false"  # long reads would draw one on a server's stdout
COMMIT_ATTEMPTS = 40  # a commit that keeps losing to other writers' (see Lake.commit) gives up after these
# rows per row group of the data files writers add (DuckLake's own parquet_row_group_size, set at creation): a
# commit's file is one row group, which a replica reads in a few requests
ROW_GROUP_ROWS = 16384
# changes a snapshot records (ducklake_snapshot_changes) that add no rows to a table that existed before it
_ADDS_NO_ROWS = {"created_schema", "created_table", "altered_table", "merge_adjacent"}
# what rollouts_between returns: each row's DuckLake row id and the snapshot that added it, then the stored columns
ROLLOUT_ROWS_SCHEMA = pa.schema([pa.field("rowid", pa.int64()), pa.field("snapshot_id", pa.int64()),
                                 *ROLLOUT_ARROW_SCHEMA])
# DuckDB types of the Arrow types in the stored schemas (DDL keeps NOT NULL, which CREATE TABLE AS would drop)
_DUCK_TYPES = {
    pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float32(): "FLOAT", pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN", pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ", pa.list_(pa.int32()): "INTEGER[]",
    pa.list_(pa.float32()): "FLOAT[]",
}


class LakeError(RuntimeError):
    """A lake operation failed; the message says what and what to do."""


class LakeUnavailable(LakeError):
    """The catalog or the data files cannot be reached (down, wrong address, wrong credentials)."""


class ExtensionMissing(LakeError):
    """DuckDB or one of its lake extensions is missing or of another version than the pinned one."""


# ---------------------------------------------------------------------------------------------- configuration


class LakeConfig(BaseSettings):
    """Where a lake lives and how to reach it: GRAFT_LAKE_<FIELD>, and the usual AWS_* variables for S3."""

    model_config = SettingsConfigDict(env_prefix="GRAFT_LAKE_", extra="forbid", populate_by_name=True)

    catalog: str = Field(repr=False, description="DuckLake catalog: 'ducklake:postgres:dbname=... host=... user=...' "
                                                 "(many hosts) or 'ducklake:sqlite:/path/catalog.sqlite' (one host)")
    data_path: str | None = Field(default=None, description="where a new lake puts its Parquet files: s3://bucket/prefix/ "
                                                            "or a shared directory (an existing lake remembers its own)")
    s3_endpoint: str | None = Field(default=None, validation_alias=AliasChoices(
        "s3_endpoint", "GRAFT_LAKE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        description="S3-compatible endpoint, e.g. http://127.0.0.1:9000 (default: AWS)")
    s3_region: str = Field(default="us-east-1", validation_alias=AliasChoices(
        "s3_region", "GRAFT_LAKE_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"), description="S3 region")
    s3_key_id: str | None = Field(default=None, validation_alias=AliasChoices(
        "s3_key_id", "GRAFT_LAKE_S3_KEY_ID", "AWS_ACCESS_KEY_ID"), description="S3 access key id")
    s3_secret: str | None = Field(default=None, repr=False, validation_alias=AliasChoices(
        "s3_secret", "GRAFT_LAKE_S3_SECRET", "AWS_SECRET_ACCESS_KEY"), description="S3 secret access key")
    s3_session_token: str | None = Field(default=None, repr=False, validation_alias=AliasChoices(
        "s3_session_token", "GRAFT_LAKE_S3_SESSION_TOKEN", "AWS_SESSION_TOKEN"), description="S3 session token")
    s3_url_style: Literal["path", "vhost"] | None = Field(default=None, description="S3 addressing; default: path "
                                                                                   "with an endpoint, else vhost")
    memory_limit: str = Field(default="512MB", description="DuckDB memory limit of a lake connection")
    # one thread: a commit of 8192 rollouts (Parquet encoding and upload) cost 27 us of CPU per rollout on one
    # thread and 55 on two; writers scale by running more processes
    threads: int = Field(default=1, ge=1, description="DuckDB threads of a lake connection")
    file_cache: bool = Field(default=True, description="keep data files' blocks in DuckDB's memory (writers re-read the "
                                                       "group ids of every commit; a replica reads each file once)")

    @field_validator("catalog")
    @classmethod
    def _catalog_kind(cls, value: str) -> str:
        value = value.strip()
        if not value.startswith(LAKE_PREFIX):
            value = LAKE_PREFIX + value
        kind = value[len(LAKE_PREFIX):].split(":", 1)[0]
        if kind not in ("postgres", "sqlite"):
            raise ValueError(f"lake catalog {redact(value)!r}: use 'ducklake:postgres:<libpq connection string>' "
                             "(many hosts) or 'ducklake:sqlite:<path>' (one host); a DuckDB-file catalog admits one "
                             "process only")
        return value

    @property
    def kind(self) -> str:
        return self.catalog[len(LAKE_PREFIX):].split(":", 1)[0]

    def env(self) -> dict[str, str]:
        """This config as GRAFT_LAKE_* variables, for another process (`LakeConfig()` there reads them back)."""
        return {f"GRAFT_LAKE_{name.upper()}": str(value) for name, value in self.model_dump().items() if value is not None}

    def describe(self) -> str:
        """The catalog with any password hidden, and the data path: for messages and logs."""
        return f"{redact(self.catalog)} (data {self.data_path or 'as the catalog says'})"


def redact(text: str) -> str:
    """Hide passwords in libpq connection strings and URLs."""
    text = re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", text, flags=re.IGNORECASE)
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


# ---------------------------------------------------------------------------------------------- extensions


def check_duckdb_version() -> None:
    if duckdb.__version__ != PINNED_DUCKDB:
        raise ExtensionMissing(
            f"duckdb {duckdb.__version__} is installed; the lake needs duckdb=={PINNED_DUCKDB}, the version whose "
            f"extensions are published as PyPI wheels: pip install 'duckdb=={PINNED_DUCKDB}' (or `pip install -e .[lake]`)")


def load_extensions(con: duckdb.DuckDBPyConnection) -> None:
    """Install the lake's extensions from their PyPI wheels into `con`'s database, then load them.

    Raises ExtensionMissing naming the package to install when a wheel is missing or of another version.
    """
    check_duckdb_version()
    try:
        from duckdb_extensions import import_extension
    except ImportError as exc:
        raise ExtensionMissing(f"the lake needs duckdb-extensions=={PINNED_DUCKDB} and its extension wheels: "
                               "pip install -e '.[lake]'") from exc
    for module, load_name in EXTENSIONS.items():
        package = f"duckdb-extension-{module}"
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise ExtensionMissing(f"DuckDB extension {module!r} is not installed: pip install '{package}=={PINNED_DUCKDB}' "
                                   "(or pip install -e '.[lake]'); extensions are never downloaded at run time") from None
        if installed != PINNED_DUCKDB:
            raise ExtensionMissing(f"{package} {installed} is installed, DuckDB is {PINNED_DUCKDB}: "
                                   f"pip install '{package}=={PINNED_DUCKDB}'")
        try:
            import_extension(module, con=con)  # INSTALL from the wheel's file; does not load
            con.execute(f"LOAD {load_name}")
        except (duckdb.Error, OSError, ModuleNotFoundError) as exc:
            raise ExtensionMissing(f"cannot load DuckDB extension {module!r} from {package}: {exc}; reinstall it: "
                                   f"pip install --force-reinstall '{package}=={PINNED_DUCKDB}'") from exc


def lake_connection(config: LakeConfig) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the lake's extensions loaded and S3 credentials set (not attached)."""
    con = duckdb.connect(config={
        "autoinstall_known_extensions": False, "autoload_known_extensions": False,
        "memory_limit": config.memory_limit, "threads": config.threads,
    })
    try:
        con.execute(NO_PROGRESS_BAR)
        load_extensions(con)
        con.execute("SET ducklake_max_retry_count = 100")  # many writers: a lost race is retried, not an error
        # hand freed memory back after each read: a replica reading 8192-rollout commits peaked at 950 MB with the
        # defaults (128/512 MB) and 710 MB with these
        con.execute("SET allocator_flush_threshold = '16MB'")
        con.execute("SET allocator_bulk_deallocation_flush_threshold = '16MB'")
        con.execute(f"SET enable_external_file_cache = {str(config.file_cache).lower()}")
        con.execute("SET TimeZone = 'UTC'")
        if config.s3_endpoint or config.s3_key_id:
            con.execute(s3_secret_sql(config))
    except BaseException:
        con.close()
        raise
    return con


def s3_secret_sql(config: LakeConfig) -> str:
    """CREATE SECRET for the data files on S3 (DuckDB's httpfs), from the config's endpoint and credentials."""
    def quote(value: str) -> str:
        return "'" + value.replace("'", "''") + "'"

    parts = ["TYPE s3", f"REGION {quote(config.s3_region)}"]
    if config.s3_key_id:
        parts += [f"KEY_ID {quote(config.s3_key_id)}", f"SECRET {quote(config.s3_secret or '')}"]
        if config.s3_session_token:
            parts.append(f"SESSION_TOKEN {quote(config.s3_session_token)}")
    url_style = config.s3_url_style
    if config.s3_endpoint:
        endpoint = config.s3_endpoint.rstrip("/")
        use_ssl = not endpoint.startswith("http://")
        endpoint = re.sub(r"^https?://", "", endpoint)
        parts += [f"ENDPOINT {quote(endpoint)}", f"USE_SSL {'true' if use_ssl else 'false'}"]
        url_style = url_style or "path"
    if url_style:
        parts.append(f"URL_STYLE {quote(url_style)}")
    return f"CREATE OR REPLACE SECRET graft_lake_s3 ({', '.join(parts)})"


# ---------------------------------------------------------------------------------------------- the lake


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


@dataclass(frozen=True)
class LakeCommit:
    """What a commit did: groups added, group ids the lake already held (not added again), problems added."""

    accepted_groups: int
    duplicate_groups: list[str]
    problems_added: int
    rollouts: int


def column_ddl(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {_DUCK_TYPES[f.type]}{'' if f.nullable else ' NOT NULL'}" for f in schema)


def _rollback_quietly(con: duckdb.DuckDBPyConnection) -> None:
    """End a failed transaction; a failed COMMIT has ended it already."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass


def _retryable(exc: LakeError) -> bool:
    text = str(exc).lower()
    return "database is locked" in text or "exceeded the maximum retry count" in text


def _unavailable_markers(message: str) -> bool:
    text = message.lower()
    return any(marker in text for marker in (
        "unable to connect", "connection refused", "could not connect", "could not establish", "connection reset",
        "timeout", "timed out", "server closed the connection", "password authentication failed", "http 403",
        "http 401", "forbidden", "accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch", "nosuchbucket",
        "no such host", "name or service not known", "failed to resolve", "unable to open database",
        "http error", "http get error", "http put error", "http head error", "connection error",
    ))


class _Attached:
    """One attach of the lake: its DuckDB connection, each thread's cursor of it, and how many calls use it now
    (a detached one is closed when the last of them ends, never under a call)."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con
        self.cursors = threading.local()
        self.users = 0
        self.detached = False

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """The calling thread's cursor (the caller holds the Lake's lock: making cursors is not thread-safe)."""
        cursor = getattr(self.cursors, "cursor", None)
        if cursor is None:
            cursor = self.cursors.cursor = self.con.cursor()
            cursor.execute(NO_PROGRESS_BAR)  # a connection's own setting: each cursor needs it
        return cursor

    def close(self) -> None:
        try:
            self.con.close()  # and its cursors
        except duckdb.Error:
            pass


class Lake:
    """One process's handle on a lake: attach, commit groups, follow snapshots, maintain. Thread-safe.

    Reads and writes go through a DuckDB cursor per thread (cursors share the attached lake and each has its
    own transaction). After an error that says the catalog or the storage cannot be reached, or a `reset()`,
    the next call attaches afresh; calls running meanwhile finish on the old attach, closed after the last.
    """

    def __init__(self, config: LakeConfig, create: bool = True):
        self.config = config
        self.create = create
        self._attached: _Attached | None = None
        self.data_path: str | None = config.data_path  # the lake's own once attached
        self._last_snapshot: Snapshot | None = None
        self._lock = threading.Lock()  # guards _attached, its users and the making of cursors
        self._encrypted = False
        self._rollouts_path = ""  # where the rollouts table's data files go (DuckLake's table path), once attached
        self._s3 = None  # boto3 S3 client of the data files (S3 data paths), made when attaching

    # ------------------------------------------------------------------ attaching

    def open(self) -> Lake:
        """Attach the lake (creating its tables when `create` and it has none); LakeUnavailable/LakeError else."""
        self._release(self._acquire()[0])
        return self

    def _attach(self) -> _Attached:
        """A new attach of the lake. Runs without the lock: an attach takes seconds (more while the catalog is
        down), and calls on the current one, or other threads' attaches, must not wait for it."""
        con = lake_connection(self.config)
        options = ["DATA_INLINING_ROW_LIMIT 0"]  # every commit writes Parquet to the data path, none into the catalog
        if self.config.data_path:
            options.append(f"DATA_PATH '{self.config.data_path.replace(chr(39), chr(39) * 2)}'")
        catalog = self.config.catalog.replace("'", "''")
        for attempt in itertools.count():
            try:
                con.execute(f"ATTACH '{catalog}' AS {ALIAS} ({', '.join(options)})")
                break
            except duckdb.Error as exc:
                # processes attaching a new lake at once race to create DuckLake's own catalog tables: the losers
                # find them made on the next try
                racing = "failed to initialize ducklake" in str(exc).lower() and not _unavailable_markers(str(exc))
                if attempt < 5 and racing:
                    time.sleep(random.uniform(0.05, 0.2))
                    continue
                con.close()
                raise self._error("attach", exc) from None  # the cause's text may hold a password: said, redacted
        try:
            for attempt in itertools.count():
                try:
                    self._ensure_tables(con)
                    break
                except (duckdb.Error, LakeError) as exc:
                    # a SQLite catalog answers "database is locked" while another process commits (writers
                    # starting together, one creating the tables): look again
                    if attempt >= 10 or "database is locked" not in str(exc).lower():
                        raise
                    _rollback_quietly(con)
                    time.sleep(random.uniform(0.05, 0.2) * (attempt + 1))
            options = dict(con.execute(f"SELECT option_name, value FROM {ALIAS}.options()").fetchall())
            self.data_path = options["data_path"]
            self._encrypted = options.get("encrypted", "false").lower() == "true"
            self._rollouts_path = _rollouts_path(con, self.data_path)
            if self._rollouts_path.startswith("s3://"):
                self._s3_client()  # importing boto3 and making its client takes ~0.6 s: at start, not in a commit
        except BaseException:
            con.close()
            raise
        return _Attached(con)

    def _ensure_tables(self, con: duckdb.DuckDBPyConnection) -> None:
        tables = {row[0] for row in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [ALIAS]).fetchall()}
        if "rollouts" not in tables:
            if not self.create:
                raise LakeError(f"lake {self.config.describe()} has no rollouts table: create it with a writer or "
                                "`graft-store migrate`, or check the catalog")
            try:
                con.execute("BEGIN")
                con.execute(f"CREATE TABLE IF NOT EXISTS {ALIAS}.rollouts ({column_ddl(ROLLOUT_ARROW_SCHEMA)})")
                con.execute(f"ALTER TABLE {ALIAS}.rollouts SET PARTITIONED BY (model_id)")
                con.execute(f"COMMENT ON TABLE {ALIAS}.rollouts IS '{LAYOUT_COMMENT}'")
                con.execute(f"CREATE TABLE IF NOT EXISTS {ALIAS}.problems ({column_ddl(PROBLEM_ARROW_SCHEMA)})")
                # zstd for the bulk columns (tokens, logprobs, text); row groups bound a writer's and a merge's memory
                con.execute(f"CALL {ALIAS}.set_option('parquet_compression', 'zstd')")
                con.execute(f"CALL {ALIAS}.set_option('parquet_compression_level', 1)")
                con.execute(f"CALL {ALIAS}.set_option('parquet_row_group_size', {ROW_GROUP_ROWS})")
                con.execute("COMMIT")
                log.info("created the rollouts and problems tables in lake %s", self.config.describe())
            except duckdb.Error as exc:
                _rollback_quietly(con)
                # another process created them at the same time (a DuckLake conflict): use theirs
                tables = {row[0] for row in con.execute(
                    "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [ALIAS]).fetchall()}
                if "rollouts" not in tables:
                    raise self._error("create the tables of", exc) from None
        comment = con.execute("SELECT comment FROM duckdb_tables() WHERE database_name = ? AND table_name = 'rollouts'",
                              [ALIAS]).fetchall()
        columns = con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE database_name = ? AND "
                              "table_name = 'rollouts' ORDER BY column_index", [ALIAS]).fetchall()
        expected = [(f.name, _DUCK_TYPES[f.type]) for f in ROLLOUT_ARROW_SCHEMA]
        actual = [(name, "TIMESTAMPTZ" if kind == "TIMESTAMP WITH TIME ZONE" else kind) for name, kind in columns]
        if actual != expected or not comment or comment[0][0] != LAYOUT_COMMENT:
            raise LakeError(f"lake {self.config.describe()}: its rollouts table is not one this store wrote "
                            f"({LAYOUT_COMMENT!r}, the columns of ROLLOUT_ARROW_SCHEMA); found comment "
                            f"{comment[0][0] if comment else None!r} and columns {actual[:4]}...")

    def _acquire(self) -> tuple[_Attached, duckdb.DuckDBPyConnection]:
        """The current attach (attaching if there is none), counted as used until `_release`, and this thread's
        cursor of it."""
        while True:
            with self._lock:
                attached = self._attached
                if attached is not None:
                    attached.users += 1
                    return attached, attached.cursor()
            fresh: _Attached | None = self._attach()
            with self._lock:
                if self._attached is None:
                    self._attached, fresh = fresh, None
            if fresh is not None:  # another thread attached meanwhile: theirs is used
                fresh.close()

    def _release(self, attached: _Attached) -> None:
        with self._lock:
            attached.users -= 1
            if attached.detached and not attached.users:
                attached.close()

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """This thread's cursor of the current attach, for one-off statements (tests, plain SQL). Not counted as
        used: a `reset()` meanwhile closes it; the lake's own calls go through `_run`."""
        attached, cursor = self._acquire()
        self._release(attached)
        return cursor

    def _error(self, action: str, exc: BaseException) -> LakeError:
        message = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip()) or type(exc).__name__
        if _unavailable_markers(str(exc)):
            return LakeUnavailable(f"cannot {action} lake {self.config.describe()}: {redact(message)}. Check that the "
                                   "catalog and the storage are up and the credentials are right; nothing was changed")
        return LakeError(f"cannot {action} lake {self.config.describe()}: {redact(message)}")

    def _run(self, action: str, work):
        """Run `work(cursor)`; on a lake that cannot be reached, drop the attach (the next call re-attaches)."""
        attached, cursor = self._acquire()
        try:
            return work(cursor)
        except duckdb.Error as exc:
            error = self._error(action, exc)
        finally:
            self._release(attached)
        if isinstance(error, LakeUnavailable):
            self.reset()
        raise error from None  # its message has the cause's text, passwords hidden

    def reset(self) -> None:
        """Detach: the next call attaches afresh (after the catalog or the storage came back, or to drop DuckDB's
        caches). Calls using the old attach finish on it; it is closed after the last of them."""
        with self._lock:
            attached, self._attached = self._attached, None
            if attached is not None:
                attached.detached = True
                if not attached.users:
                    attached.close()

    def close(self) -> None:
        self.reset()

    def __enter__(self) -> Lake:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ writing

    def commit(self, table: pa.Table | None, problems: list[Problem] | tuple = ()) -> LakeCommit:
        """Commit a validated table of whole groups (None: problems only) and their problems in one transaction.

        Groups the lake already holds (the same id, model and prompt) are skipped (returned as duplicates): a
        retried commit adds nothing. A group id the lake holds under another model or prompt raises GroupConflict
        and commits nothing, as the local store's push. Raises LakeUnavailable / LakeError; then nothing of this
        commit is visible.
        """
        table = ROLLOUT_ARROW_SCHEMA.empty_table() if table is None else table
        starts, _ = group_runs(table.column("group_id"))
        incoming = table.select(["group_id", "model_id", "prompt_id"]).take(pa.array(starts, pa.int64()))
        problem_rows = pa.Table.from_pylist([p.model_dump() for p in problems], schema=PROBLEM_ARROW_SCHEMA)

        def work(con: duckdb.DuckDBPyConnection) -> LakeCommit:
            con.execute("BEGIN")
            try:
                con.register("incoming_groups", incoming)
                # every model's files: a group id is unique in the lake, as in the local store (the files' group_id
                # statistics prune what they can)
                duplicates, conflicts = _stored_already(con, incoming)
                if conflicts:
                    raise GroupConflict(conflicts)
                fresh = table
                if duplicates:
                    held = pa.array(duplicates, pa.string())
                    fresh = table.filter(pc.invert(pc.is_in(table.column("group_id"), held)))
                for path in self._write_data_files(fresh):  # none is referenced until the COMMIT below lands
                    con.execute(f"CALL ducklake_add_data_files('{ALIAS}', 'rollouts', {_quote(path)})")
                added = 0
                if problem_rows.num_rows:
                    con.register("incoming_problems", problem_rows)
                    added = con.execute(f"""
                        INSERT INTO {ALIAS}.problems BY NAME
                        SELECT DISTINCT ON (dataset, prompt_id) * FROM incoming_problems p
                        WHERE NOT EXISTS (SELECT 1 FROM {ALIAS}.problems q
                                          WHERE q.dataset = p.dataset AND q.prompt_id = p.prompt_id)""").fetchall()[0][0]
                con.execute("COMMIT")
            except BaseException:
                _rollback_quietly(con)
                raise
            finally:
                for name in ("incoming_groups", "incoming_problems"):
                    try:
                        con.unregister(name)
                    except duckdb.Error:
                        pass
            return LakeCommit(accepted_groups=incoming.num_rows - len(duplicates), duplicate_groups=sorted(duplicates),
                              problems_added=int(added), rollouts=fresh.num_rows)

        # DuckLake retries a commit that lost the race for the next snapshot by itself; a SQLite catalog can also
        # answer "database is locked" while another process commits: then the whole transaction runs again (its
        # duplicate check included, so nothing lands twice)
        for attempt in itertools.count():
            try:
                return self._run("commit to", work)
            except LakeError as exc:
                if attempt >= COMMIT_ATTEMPTS - 1 or not _retryable(exc):
                    raise
                time.sleep(random.uniform(0.5, 1.5) * min(2.0, 0.02 * 1.5 ** attempt))
        raise AssertionError("unreachable")

    def _write_data_files(self, rows: pa.Table) -> Iterator[str]:
        """Write validated rows as one Parquet data file per model under the rollouts table's path, in DuckLake's
        partition layout (`model_id=<model>/`, which `ducklake_add_data_files` reads the partition value from);
        yield each file's path once it is whole in the storage (S3: one PUT; a directory: temporary name, fsync,
        rename). Until a commit references them they are orphans, which `maintain()` deletes."""
        if not rows.num_rows:
            return
        if self._encrypted:
            raise LakeError(f"lake {self.config.describe()} encrypts its data files (DuckLake's 'encrypted' option); "
                            "graft's writers write their own Parquet files and do not encrypt them: write to a lake "
                            "made without encryption")
        models = pc.unique(rows.column("model_id")).to_pylist()
        for model in models:
            of_model = rows if len(models) == 1 else rows.filter(pc.equal(rows.column("model_id"), model))
            sink = pa.BufferOutputStream()
            # the local store's shard codecs: zstd level 1 on the bulk columns only, no dictionaries; statistics on
            # the small columns (DuckLake prunes files by them, e.g. a commit's duplicate check on group_id)
            pq.write_table(of_model, sink, row_group_size=ROW_GROUP_ROWS, compression=COMPRESSION,
                           use_dictionary=False, write_statistics=SMALL_COLUMNS_SCHEMA.names, write_page_checksum=True)
            path = f"{self._rollouts_path}model_id={model}/ducklake-{uuid.uuid4()}.parquet"
            self._put(path, sink.getvalue())
            yield path

    def _put(self, path: str, body: pa.Buffer) -> None:
        """Store a whole file at `path` (s3://bucket/key or a local path); LakeUnavailable when the storage cannot
        be reached or refuses it."""
        if not path.startswith("s3://"):
            tmp = f"{os.path.dirname(path)}/.tmp-{os.path.basename(path)}"
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    f.write(body)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, path)
                fsync_directory(os.path.dirname(path))
            except OSError as exc:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise LakeUnavailable(f"cannot commit to lake {self.config.describe()}: writing data file {path} "
                                      f"failed: {exc}; nothing was committed") from None
            return
        from botocore.exceptions import BotoCoreError, ClientError  # boto3 is there: _attach made its client

        bucket, key = path.removeprefix("s3://").split("/", 1)
        try:
            self._s3_client().put_object(Bucket=bucket, Key=key, Body=pa.BufferReader(body))
        except (BotoCoreError, ClientError) as exc:  # refused (403, no such bucket) or not reached
            raise _storage_error(exc, f"cannot commit to lake {self.config.describe()}: uploading data file {path} "
                                      "failed", "; nothing was committed") from None

    def _get(self, path: str) -> bytes:
        """A whole data file's bytes (s3://bucket/key or a local path); LakeUnavailable when the storage cannot be
        reached, LakeError when the file is missing or refused."""
        if not path.startswith("s3://"):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise LakeError(f"cannot read rollouts from lake {self.config.describe()}: data file {path}: "
                                f"{exc}") from None
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, key = path.removeprefix("s3://").split("/", 1)
        try:
            return self._s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise _storage_error(exc, f"cannot read rollouts from lake {self.config.describe()}: data file {path}") from None

    def _s3_client(self):
        """boto3's S3 client for the data files (made once per Lake; boto3 clients are thread-safe), from the
        config's endpoint, region, credentials and addressing (the ones DuckDB's secret gets, see s3_secret_sql);
        without a key id, unsigned requests, as DuckDB's."""
        if self._s3 is None:
            try:
                import boto3
                from botocore import UNSIGNED
                from botocore.config import Config
            except ImportError as exc:
                raise ExtensionMissing("the lake's writers upload data files with boto3: pip install -e '.[lake]'") from exc
            url_style = self.config.s3_url_style or ("path" if self.config.s3_endpoint else "virtual")
            config = Config(
                s3={"addressing_style": "virtual" if url_style == "vhost" else url_style,
                    "payload_signing_enabled": False},  # no SHA-256 of the body (~2 us/rollout): a CRC32 checks it
                retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10, read_timeout=120,
                **({} if self.config.s3_key_id else {"signature_version": UNSIGNED}))
            self._s3 = boto3.session.Session().client(
                "s3", endpoint_url=self.config.s3_endpoint, region_name=self.config.s3_region,
                aws_access_key_id=self.config.s3_key_id, aws_secret_access_key=self.config.s3_secret,
                aws_session_token=self.config.s3_session_token, config=config)
        return self._s3

    # ------------------------------------------------------------------ reading

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

        return self._run("read the snapshot of", work)

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
            files = [DataFile(int(snapshot), path if not relative else self._rollouts_path + path, int(count),
                              int(row_id_start)) for snapshot, path, relative, count, row_id_start, _ in rows]
            # only S3 and paths are fetched here: a file on other storage DuckDB reaches (gs://, az://, https://) is
            # read through the change feed
            if any(re.match(r"[a-z][a-z0-9+.-]*://", f.path) and not f.path.startswith("s3://") for f in files):
                return None
            return files

        return self._run("read the data files of", work)

    def _read_files(self, files: list[DataFile]) -> AddedRows | None:
        """The rows of data files (`files_added`) with their row ids and snapshot ids, in commit order; None when a
        file's columns are not the rollouts table's by name (then the change feed reads it, as DuckDB would).
        A file that cannot be fetched or decoded, or holds another number of rows than the catalog says, raises
        LakeError / pa.ArrowException, as a damaged file read through DuckDB does."""
        parts, bodies = [ROLLOUT_ROWS_SCHEMA.empty_table()], {}
        for file in files:
            body = self._get(file.path)
            rows = pq.read_table(pa.BufferReader(body))
            if rows.schema.names != ROLLOUT_ARROW_SCHEMA.names:
                return None
            if rows.num_rows != file.rows:
                raise LakeError(f"lake {self.config.describe()}: data file {file.path} of snapshot {file.snapshot_id} "
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

        return self._run("read the snapshots of", work)

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

        return self._run(f"read {table} from", work)

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

        return self._run("read group ids from", work)

    def counts(self) -> dict[str, int]:
        """Rows, distinct groups and data files of the rollouts table at the newest snapshot."""
        def work(con):
            rows, groups = con.execute(
                f"SELECT count(*), count(DISTINCT group_id) FROM {ALIAS}.rollouts").fetchall()[0]
            files = con.execute(f"SELECT count(*) FROM ducklake_list_files('{ALIAS}', 'rollouts')").fetchall()[0][0]
            return {"rollouts": int(rows), "groups": int(groups), "files": int(files)}

        return self._run("count", work)

    # ------------------------------------------------------------------ maintenance

    def maintain(self, expire_older_than_s: float, cleanup_older_than_s: float) -> dict[str, int]:
        """DuckLake's maintenance: merge adjacent small files (row ids and snapshot ids kept, so followers see
        nothing new), expire snapshots older than `expire_older_than_s`, delete files scheduled for deletion
        and orphaned files (left by writers killed mid-commit) older than `cleanup_older_than_s`."""
        def work(con):
            before = con.execute(f"SELECT count(*) FROM ducklake_list_files('{ALIAS}', 'rollouts')").fetchall()[0][0]
            con.execute(f"CALL ducklake_merge_adjacent_files('{ALIAS}')")
            after = con.execute(f"SELECT count(*) FROM ducklake_list_files('{ALIAS}', 'rollouts')").fetchall()[0][0]
            expire_before = _interval_ago(expire_older_than_s)
            expired = con.execute(f"SELECT count(*) FROM ducklake_expire_snapshots('{ALIAS}', "
                                  f"older_than => {expire_before})").fetchall()[0][0]
            cleanup_before = _interval_ago(cleanup_older_than_s)
            deleted = con.execute(f"SELECT count(*) FROM ducklake_cleanup_old_files('{ALIAS}', "
                                  f"older_than => {cleanup_before})").fetchall()[0][0]
            orphans = con.execute(
                f"SELECT count(*) FROM ducklake_delete_orphaned_files('{ALIAS}', older_than => {cleanup_before})"
            ).fetchall()[0][0]
            return {"files_before": int(before), "files_after": int(after), "snapshots_expired": int(expired),
                    "files_deleted": int(deleted), "orphans_deleted": int(orphans)}

        return self._run("maintain", work)


def _stored_already(con: duckdb.DuckDBPyConnection, incoming: pa.Table) -> tuple[list[str], dict[str, GroupRef]]:
    """Of the groups in the registered `incoming_groups` (group_id, model_id, prompt_id), those the lake holds:
    duplicates (the same model and prompt) and conflicts (another model or prompt, with the stored group's
    GroupRef: its first copy by row id, `seq` its first row id, no local file)."""
    rows = con.execute(f"""
        SELECT group_id, arg_min(model_id, rowid), arg_min(prompt_id, rowid), arg_min(policy_step, rowid),
               max(epoch_us(created_at)), count(*) FILTER (WHERE correct), arg_min(group_size, rowid), min(rowid),
               count(*)
        FROM {ALIAS}.rollouts WHERE group_id IN (SELECT group_id FROM incoming_groups) GROUP BY group_id""").fetchall()
    if not rows:
        return [], {}
    wanted = {g: (m, p) for g, m, p in zip(*(incoming.column(n).to_pylist() for n in ("group_id", "model_id", "prompt_id")))}
    duplicates, conflicts = [], {}
    for gid, model, prompt, step, created, successes, size, first_row, count in rows:
        if wanted[gid] == (model, prompt):
            duplicates.append(gid)
        else:  # successes and rows count every copy the lake holds: the message shows model and prompt only
            conflicts[gid] = GroupRef(gid, prompt, model, step, created, successes, size, first_row, "", 0, count)
    return duplicates, conflicts


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


def _storage_error(exc: Exception, head: str, tail: str = "") -> LakeError:
    """A boto3 error on a data file as the lake's error, "<head>: <its message, redacted>. Check ...<tail>":
    LakeUnavailable when the storage cannot be reached or refuses the credentials, LakeError else."""
    message = redact(" ".join(str(exc).split()))
    kind = LakeUnavailable if _unavailable_markers(message) else LakeError
    return kind(f"{head}: {message}. Check that the storage is up and the credentials are right{tail}")


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _rollouts_path(con: duckdb.DuckDBPyConnection, data_path: str) -> str:
    """The rollouts table's own path, where DuckLake puts its data files: the table's path under its schema's
    under the data path, each either relative to the one above or absolute (DuckLake's catalog tables)."""
    meta = f"__ducklake_metadata_{ALIAS}"
    row = con.execute(f"""
        SELECT s.path, s.path_is_relative, t.path, t.path_is_relative
        FROM {meta}.ducklake_table t JOIN {meta}.ducklake_schema s USING (schema_id)
        WHERE t.table_name = 'rollouts' AND t.end_snapshot IS NULL AND s.end_snapshot IS NULL""").fetchall()
    path = data_path if data_path.endswith("/") else data_path + "/"
    for part, relative in ((row[0][0], row[0][1]), (row[0][2], row[0][3])) if row else ():
        if part:
            path = path + part if relative else part
    return path if path.endswith("/") else path + "/"


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


def _interval_ago(seconds: float) -> str:
    return f"now() - INTERVAL '{max(0.0, float(seconds)):.6f} seconds'"
