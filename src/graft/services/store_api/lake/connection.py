"""One process's connection to a lake: attaching it (and making its tables), the connection discipline every
call goes through (`LakeConnection.run`: a reset never closes a connection another thread uses), the mapping of
DuckDB's and the storage's errors to `LakeError`/`LakeUnavailable`, and the data files' storage (a directory or
S3). The part of `Lake` (lake.py) that its other parts (writing.py, reading.py, maintenance.py) work through."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from typing import Self

import duckdb
import pyarrow as pa

from graft.schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA
from graft.schemas.rollout import ADDED_COLUMNS
from graft.services.store_api.lake.config import (
    NO_PROGRESS_BAR,
    ExtensionMissing,
    LakeConfig,
    LakeError,
    LakeUnavailable,
    lake_connection,
    redact,
)

log = logging.getLogger("graft.store.lake")

ALIAS = "lake"  # the lake's name inside each DuckDB connection
LAYOUT_COMMENT = "graft rollouts, layout 1"  # on the rollouts table: a lake this store made, in this layout
# rows per row group of the data files writers add (DuckLake's own parquet_row_group_size, set at creation): a
# commit's file is one row group, which a replica reads in a few requests
ROW_GROUP_ROWS = 16384
# DuckDB types of the Arrow types in the stored schemas (DDL keeps NOT NULL, which CREATE TABLE AS would drop)
_DUCK_TYPES = {
    pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.float32(): "FLOAT", pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN", pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ", pa.list_(pa.int32()): "INTEGER[]",
    pa.list_(pa.float32()): "FLOAT[]",
}



def column_ddl(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {_DUCK_TYPES[f.type]}{'' if f.nullable else ' NOT NULL'}" for f in schema)


def _rollback_quietly(con: duckdb.DuckDBPyConnection) -> None:
    """End a failed transaction; a failed COMMIT has ended it already."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass



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



class LakeConnection:
    """The attach of a lake and the calls on it (`run`); `Lake` holds it and the parts that commit, read and
    maintain through it.

    Reads and writes go through a DuckDB cursor per thread (cursors share the attached lake and each has its
    own transaction). After an error that says the catalog or the storage cannot be reached, or a `reset()`,
    the next call attaches afresh; calls running meanwhile finish on the old attach, closed after the last.
    """

    def __init__(self, config: LakeConfig, create: bool = True):
        self.config = config
        self.create = create
        self._attached: _Attached | None = None
        self.data_path: str | None = config.data_path  # the lake's own once attached
        self._lock = threading.Lock()  # guards _attached, its users and the making of cursors
        self._encrypted = False
        self._rollouts_path = ""  # where the rollouts table's data files go (DuckLake's table path), once attached
        self._s3 = None  # boto3 S3 client of the data files (S3 data paths), made when attaching

    @property
    def encrypted(self) -> bool:
        """Whether the lake encrypts its data files (DuckLake's 'encrypted' option), once attached."""
        return self._encrypted

    @property
    def rollouts_path(self) -> str:
        """Where the rollouts table's data files go (DuckLake's table path, ending in /), once attached."""
        return self._rollouts_path

    # ------------------------------------------------------------------ attaching

    def open(self) -> Self:
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
                self.s3_client()  # importing boto3 and making its client takes ~0.6 s: at start, not in a commit
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
        expected = [(f.name, _DUCK_TYPES[f.type]) for f in ROLLOUT_ARROW_SCHEMA]
        actual = self._rollout_columns(con)
        before_added = [column for column in expected if column[0] not in ADDED_COLUMNS]
        if actual == before_added and comment and comment[0][0] == LAYOUT_COMMENT:
            self._add_columns(con)  # a lake made before schema version 3
            actual = self._rollout_columns(con)
        if actual != expected or not comment or comment[0][0] != LAYOUT_COMMENT:
            raise LakeError(f"lake {self.config.describe()}: its rollouts table is not one this store wrote "
                            f"({LAYOUT_COMMENT!r}, the columns of ROLLOUT_ARROW_SCHEMA); found comment "
                            f"{comment[0][0] if comment else None!r} and columns {actual[:4]}...")

    @staticmethod
    def _rollout_columns(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
        columns = con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE database_name = ? AND "
                              "table_name = 'rollouts' ORDER BY column_index", [ALIAS]).fetchall()
        return [(name, "TIMESTAMPTZ" if kind == "TIMESTAMP WITH TIME ZONE" else kind) for name, kind in columns]

    def _add_columns(self, con: duckdb.DuckDBPyConnection) -> None:
        """Evolve a rollouts table of schema version 2 or 1 to version 3 in one transaction (DuckLake's schema
        evolution rewrites no data file; its rows read the new columns as null): the prompt columns, and a
        logprob_sum that may be null. Another process doing the same at once makes this one's commit fail: then
        the table is as wanted, which the caller checks."""
        try:
            con.execute("BEGIN")
            for name in ADDED_COLUMNS:
                field = ROLLOUT_ARROW_SCHEMA.field(name)
                con.execute(f"ALTER TABLE {ALIAS}.rollouts ADD COLUMN IF NOT EXISTS {name} {_DUCK_TYPES[field.type]}")
            con.execute(f"ALTER TABLE {ALIAS}.rollouts ALTER COLUMN logprob_sum DROP NOT NULL")  # null without mu
            con.execute("COMMIT")
            log.info("lake %s: added the columns of schema version 3 to the rollouts table", self.config.describe())
        except duckdb.Error as exc:
            _rollback_quietly(con)
            log.info("lake %s: adding the columns of schema version 3 failed (%s); another process may have",
                     self.config.describe(), redact(str(exc)))

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

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """This thread's cursor of the current attach, for one-off statements (tests, plain SQL). Not counted as
        used: a `reset()` meanwhile closes it; the lake's own calls go through `run`."""
        attached, cursor = self._acquire()
        self._release(attached)
        return cursor

    def _error(self, action: str, exc: BaseException) -> LakeError:
        message = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip()) or type(exc).__name__
        if _unavailable_markers(str(exc)):
            return LakeUnavailable(f"cannot {action} lake {self.config.describe()}: {redact(message)}. Check that the "
                                   "catalog and the storage are up and the credentials are right; nothing was changed")
        return LakeError(f"cannot {action} lake {self.config.describe()}: {redact(message)}")

    def run(self, action: str, work):
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

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the data files' storage

    def get_file(self, path: str) -> bytes:
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
            return self.s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise _storage_error(exc, f"cannot read rollouts from lake {self.config.describe()}: data file {path}") from None

    def s3_client(self):
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
