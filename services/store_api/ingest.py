"""How files get into the index: scanning for new shards and problem files, summarising and indexing them,
pushes over HTTP, and cleaning up what dead writers left; methods of `StoreIndex` (index.py).

A shard is indexed from a summary of one row per group (`summarise_shard`, reading only the columns the index
keeps) and checked against its lookup file; an unreadable or invalid file is quarantined. Indexing is
idempotent and the first copy of a group wins: later copies are counted in `duplicates` and skipped.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA, Problem
from services.store_api.catalog import Catalog
from services.store_api.durable import TMP_PREFIX
from services.store_api.lookup import LOOKUP_DIR, LOOKUP_SUFFIX, ShardReadError
from services.store_api.mirror import GroupRef, now_us
from services.store_api.shards import model_dir, write_problems, write_rollout_table
from services.store_api.tables import GROUP_SHARED_FIELDS, ShardValidationError, check_groups, group_runs

log = logging.getLogger("graft.store")

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


class IndexIngest(Catalog):
    """The write side of StoreIndex: new files in."""

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
            duplicate = np.fromiter((g in self.mirror for g in group_ids), bool, len(group_ids))
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
        self.mirror.add(list(map(GroupRef._make, zip(*columns, itertools.repeat(rel), *locations))))

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

    # ------------------------------------------------------------------ push ingest

    def push(self, table: pa.Table, problems: list[Problem]) -> tuple[int, list[str], str | None]:
        """Write validated groups of one model as a shard and index it at once.

        Returns (groups accepted, duplicate group ids not written, shard path relative to the root).
        """
        with self._write_lock:
            group_ids = pc.unique(table.column("group_id")).to_pylist()
            duplicates = [g for g in group_ids if g in self.mirror]
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
