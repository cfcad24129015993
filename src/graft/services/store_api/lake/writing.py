"""Committing whole groups to a lake (`LakeWriting.commit`, a part of `Lake`), in one transaction each.

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
with the same group id both land.
"""

from __future__ import annotations

import itertools
import os
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from graft.schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA, Problem
from graft.services.store_api.lake.config import LakeError, LakeUnavailable
from graft.services.store_api.lake.connection import (
    ALIAS,
    ROW_GROUP_ROWS,
    LakeConnection,
    _quote,
    _rollback_quietly,
    _storage_error,
)
from graft.services.store_api.local import GroupConflict, GroupRef, encode_shard, fsync_directory
from graft.services.store_api.tables import SMALL_COLUMNS_SCHEMA, group_runs

COMMIT_ATTEMPTS = 40  # a commit that keeps losing to other writers' (see LakeWriting.commit) gives up after these


@dataclass(frozen=True)
class LakeCommit:
    """What a commit did: groups added, group ids the lake already held (not added again), problems added."""

    accepted_groups: int
    duplicate_groups: list[str]
    problems_added: int
    rollouts: int



def _retryable(exc: LakeError) -> bool:
    text = str(exc).lower()
    return "database is locked" in text or "exceeded the maximum retry count" in text



class LakeWriting:
    """Commits of validated groups and their problems, through the lake's connection."""

    def __init__(self, connection: LakeConnection):
        self.connection = connection

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
                return self.connection.run("commit to", work)
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
        if self.connection.encrypted:
            lake = self.connection.config.describe()
            raise LakeError(f"lake {lake} encrypts its data files (DuckLake's 'encrypted' option); "
                            "graft's writers write their own Parquet files and do not encrypt them: write to a lake "
                            "made without encryption")
        models = pc.unique(rows.column("model_id")).to_pylist()
        for model in models:
            of_model = rows if len(models) == 1 else rows.filter(pc.equal(rows.column("model_id"), model))
            # the local store's shard layout (pages of whole groups, which a replica's cache serves lookups from),
            # with statistics on the small columns (DuckLake prunes files by them, e.g. a commit's duplicate check
            # on group_id)
            _, lengths = group_runs(of_model.column("group_id"))
            sink = pa.BufferOutputStream()
            encode_shard(of_model, lengths, sink, ROW_GROUP_ROWS, statistics=SMALL_COLUMNS_SCHEMA.names)
            path = f"{self.connection.rollouts_path}model_id={model}/ducklake-{uuid.uuid4()}.parquet"
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
                lake = self.connection.config.describe()
                raise LakeUnavailable(f"cannot commit to lake {lake}: writing data file {path} "
                                      f"failed: {exc}; nothing was committed") from None
            return
        from botocore.exceptions import BotoCoreError, ClientError  # boto3 is there: _attach made its client

        bucket, key = path.removeprefix("s3://").split("/", 1)
        try:
            self.connection.s3_client().put_object(Bucket=bucket, Key=key, Body=pa.BufferReader(body))
        except (BotoCoreError, ClientError) as exc:  # refused (403, no such bucket) or not reached
            lake = self.connection.config.describe()
            raise _storage_error(exc, f"cannot commit to lake {lake}: uploading data file {path} "
                                      "failed", "; nothing was committed") from None


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
