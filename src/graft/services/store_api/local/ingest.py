"""How files get into the index: scanning for new shards and problem files, checking and indexing them,
pushes over HTTP, and cleaning up what dead writers left: a part of `StoreIndex` (index.py), working through the
catalog's methods.

A shard from the folder passes the rules a push passes (`validate_shard`, through `tables.validate_table`: whole
for a foreign shard, its small columns for one its graft writer validated whole); an unreadable or invalid
file, or a folder named as the API would refuse, is quarantined with the reason. Indexing is idempotent and the first copy of a group wins: a later copy (same model and prompt) is a
duplicate, one under another model or prompt a conflict; both are counted in `duplicates` and skipped, and
the file is rewritten without them, so the files the manifest lists hold exactly the indexed groups. A push
with a conflicting group is refused (`GroupConflict`).

Just over 400 lines: the folder scan, the push and the problem files share one path into the index
(`ingest_file`: validate, drop duplicates, write the lookup file, add to the mirror), kept in one place.
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

from graft.schemas import MU_FIELDS, ROLLOUT_ARROW_SCHEMA, Problem, mu_is_behaviour
from graft.schemas.rollout import ADDED_COLUMNS
from graft.services.store_api.local.catalog import Catalog
from graft.services.store_api.local.compaction import IndexCompaction
from graft.services.store_api.local.durable import TMP_DIR, TMP_PREFIX
from graft.services.store_api.local.lookup import (
    CHUNK_ROWS,
    LOOKUP_DIR,
    LOOKUP_SUFFIX,
    ShardReadError,
    lookup_footer,
    lookup_path,
    read_whole_groups,
    shard_footer,
    shard_pages,
    write_lookup_file,
)
from graft.services.store_api.local.mirror import GroupConflict, GroupRef, now_us
from graft.services.store_api.local.shards import model_dir, write_problems, write_rollout_table
from graft.services.store_api.tables import (
    GROUP_SHARED_FIELDS,
    SAFE_NAME,
    SMALL_COLUMNS_SCHEMA,
    ShardValidationError,
    group_runs,
    validate_problems,
    validate_table,
)

log = logging.getLogger("graft.store")

PARTITIONS = (("rollouts", "model="), ("prompts", "dataset="))  # <root>/<kind>/<prefix><safe name>/


def summarise_groups(table: pa.Table, starts: np.ndarray, lengths: np.ndarray, first_row: int = 0) -> pa.Table:
    """One row per group of a validated table of whole groups: what the index keeps (rows from `first_row`)."""
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
    return pa.table({
        **{name: table.column(name).take(first) for name in GROUP_SHARED_FIELDS},
        "successes": pa.array(np.add.reduceat(correct, starts).astype(np.int32)),
        # whether the group's logprobs are its mu (schemas.mu_is_behaviour, no trust in rescored_unverified): its rows
        # share their mode and sampling, its first row says which
        "has_mu": pa.array([mu_is_behaviour(row) for row in table.select(MU_FIELDS).take(first).to_pylist()],
                           pa.bool_()),
        "scored": pa.array(n_scored.astype(np.int32)),
        "reward_sum": pa.array(reward_sum),
        "mean_reward": pa.array(np.where(none, np.nan, reward_sum / np.maximum(n_scored, 1)), mask=none),
        "min_reward": pa.array(min_reward, mask=none),
        "max_reward": pa.array(max_reward, mask=none),
        "created_us": pa.array(np.maximum.reduceat(created, starts)),
        "row_start": pa.array(starts + first_row),
        "num_rows": pa.array(lengths.astype(np.int32)),
    })


def validate_shard(path: Path, expected_model: str) -> pa.Table:
    """Check every row of a rollout shard against the rules of a push (`validate_table`) and return the index's
    summary, one row per group.

    A shard whose lookup file is bound to its footer was validated whole by its writer from the very table it
    holds (`shards.write_rollout_table`): only its small columns are decoded and checked, every rule but those
    on BULK_COLUMNS (~0.5 us per rollout instead of ~7 for decoding text, token ids and logprobs). Any other
    shard (a foreign writer's, or one rewritten since) is decoded and checked whole, and its lookup file
    written in the same pass (templates where its groups have bulk pages of their own). Reads whole groups a chunk
    at a time (memory bounded for any file). Raises ShardReadError if the file cannot be decoded,
    ShardValidationError naming the first bad row otherwise.
    """
    try:
        parquet = pq.ParquetFile(path, page_checksum_verification=True)
        schema = parquet.schema_arrow
        footer = shard_footer(path)
    except (OSError, pa.ArrowException) as exc:
        raise ShardReadError(path, str(exc)) from exc
    names = schema.names
    # a shard written before a column was added (ADDED_COLUMNS) lacks it: read as null
    expected = [f for f in ROLLOUT_ARROW_SCHEMA if f.name in names or f.name not in ADDED_COLUMNS]
    wrong = [f"{f.name}: {names.count(f.name)} columns" if names.count(f.name) != 1 else
             f"{f.name}: {schema.field(f.name).type} (expected {f.type})"
             for f in expected if names.count(f.name) != 1 or schema.field(f.name).type != f.type]
    extra = [n for n in names if n not in ROLLOUT_ARROW_SCHEMA.names]
    if wrong or extra:
        raise ShardValidationError(f"schema differs from ROLLOUT_ARROW_SCHEMA: {'; '.join(wrong[:5])}; "
                                   f"unexpected columns {extra[:5]}")
    if parquet.metadata.num_rows == 0:
        raise ShardValidationError("no rows")
    checked_by_writer = lookup_footer(lookup_path(path)) == footer
    summaries: list[pa.Table] = []
    seen: set[str] = set()

    def checked():
        # the small columns take ~150 bytes a row: 16x more rows at a time than whole rows (~3 KB each)
        chunks = (read_whole_groups(path, parquet, SMALL_COLUMNS_SCHEMA, 16 * CHUNK_ROWS) if checked_by_writer else
                  read_whole_groups(path, parquet))
        for first_row, chunk in chunks:
            try:
                chunk = validate_table(chunk, bulk=not checked_by_writer)
            except ShardValidationError as exc:
                raise ShardValidationError(f"in the rows from {first_row}: {exc}") from exc
            starts, lengths = group_runs(chunk.column("group_id"))
            group_ids = chunk.column("group_id").take(pa.array(starts)).to_pylist()
            again = seen.intersection(group_ids)
            if again:
                raise ShardValidationError(f"group {min(again)} appears in separate runs of rows; a shard holds whole "
                                           "groups, each once")
            seen.update(group_ids)
            models = pc.unique(chunk.column("model_id")).to_pylist()
            if models != [expected_model]:
                raise ShardValidationError(f"rows of model(s) {models} in the directory of model {expected_model!r}")
            summaries.append(summarise_groups(chunk, starts, lengths, first_row))
            yield first_row, chunk

    if checked_by_writer:
        for _ in checked():
            pass
    else:  # groups with bulk pages of their own get templates, the others copies
        write_lookup_file(lookup_path(path), checked(), footer, shard_pages(path, parquet))
    return pa.concat_tables(summaries)


class IndexIngest:
    """The write side of StoreIndex: new files in (a file with skipped groups is rewritten by compaction's
    `compact_files`). Owns the (dataset, prompt id) pairs of the problems indexed."""

    def __init__(self, catalog: Catalog, compaction: IndexCompaction):
        self.catalog = catalog
        self.compaction = compaction
        self._known_problems: set[tuple[str, str]] = set()

    def load(self) -> None:
        """Read which problems the index holds (after the catalog loaded or recreated its tables)."""
        self._known_problems = set(self.catalog.execute("SELECT dataset, prompt_id FROM problems"))

    def scan(self) -> list[Path]:
        """Final-named shards and problem files not yet in the index, oldest name first; on the way, quarantine
        folders named as the API would refuse and delete writers' temporary files left for tmp_max_age_s."""
        catalog = self.catalog
        found = []
        stale_before = time.time() - catalog.settings.tmp_max_age_s
        for kind, prefix in PARTITIONS:
            base = catalog.root / kind
            if not base.is_dir():
                continue
            for sub in os.scandir(base):
                if not (sub.name.startswith(prefix) and sub.is_dir()):
                    continue
                if not SAFE_NAME.match(sub.name.removeprefix(prefix)):
                    catalog.quarantine(f"{kind}/{sub.name}", f"folder {kind}/{sub.name}: the name after {prefix!r} "
                                       "must match [A-Za-z0-9._-]+, as the API requires; nothing in it was indexed")
                    continue
                for entry in os.scandir(sub.path):
                    name = entry.name
                    if name.startswith("part-") and name.endswith(".parquet"):
                        rel = f"{kind}/{sub.name}/{name}"
                        if not catalog.knows(rel):
                            found.append(catalog.root / rel)
                    elif name.startswith(TMP_PREFIX):  # left by a writer of an earlier version
                        self._remove_stale_tmp(Path(entry.path), stale_before)
        if (catalog.root / TMP_DIR).is_dir():
            for entry in os.scandir(catalog.root / TMP_DIR):
                self._remove_stale_tmp(Path(entry.path), stale_before)
        return sorted(found, key=lambda p: p.name)

    def delete_orphan_lookup_files(self) -> int:
        """Delete lookup files whose shard is neither on disk nor indexed, and temporary ones, once older than
        tmp_max_age_s: a writer that died between its lookup file and its shard leaves them behind."""
        catalog = self.catalog
        base = catalog.root / LOOKUP_DIR
        if not base.is_dir():
            return 0
        stale_before = time.time() - catalog.settings.tmp_max_age_s
        deleted = 0
        for sub in os.scandir(base):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                shard = f"rollouts/{sub.name}/{entry.name.removesuffix(LOOKUP_SUFFIX)}.parquet"
                in_use = catalog.knows(shard) or (catalog.root / shard).exists()
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
        rows = self.catalog.cursor().execute(
            "SELECT path FROM files WHERE kind = 'rollouts' AND retired_us IS NULL ORDER BY path").fetchall()
        for (rel,) in rows:
            try:
                self.catalog.reader.open(rel)
            except OSError as exc:  # ShardReadError included: the lookup that meets it quarantines the shard
                log.warning("cannot open or rebuild the lookup file of %s: %s", rel, exc)

    def _remove_stale_tmp(self, path: Path, stale_before: float) -> None:
        try:
            if path.stat().st_mtime < stale_before:
                path.unlink()
                log.warning("removed %s: a writer's temporary file untouched for %.0f s (the writer died)",
                            path, self.catalog.settings.tmp_max_age_s)
        except FileNotFoundError:
            pass

    def ingest_new(self) -> int:
        """Index every new file on disk; return the number of groups indexed."""
        total = 0
        found = self.scan()
        for path in found:
            if path.parent.parent.name == "prompts":
                self.ingest_problem_file(path)
            else:
                total += self.ingest_file(path)
        if found:
            self.catalog.write_manifest()
        return total

    def ingest_file(self, path: Path, summary: pa.Table | None = None) -> int:
        """Index one rollout shard (idempotent); quarantine it if unreadable or invalid. Return groups indexed.

        `summary`: the writer's own `summarise_groups` of the validated table it just wrote (a push); else the
        shard is read and checked whole (`validate_shard`).
        """
        catalog = self.catalog
        rel = path.relative_to(catalog.root).as_posix()
        if catalog.knows(rel):
            return 0
        try:
            stat = path.stat()
        except FileNotFoundError:
            return 0
        expected_model = path.parent.name.removeprefix("model=")
        try:
            if summary is None:
                summary = validate_shard(path, expected_model)
            # normally the writer's lookup file, checked against the groups; rebuilt from the shard if not
            catalog.reader.check(rel, summary.column("row_start").to_numpy(), summary.column("num_rows").to_numpy())
        except (ShardReadError, ShardValidationError) as exc:
            catalog.quarantine(rel, str(exc))
            return 0
        with catalog.write_lock:
            if catalog.knows(rel):
                return 0
            group_ids = summary.column("group_id").to_pylist()
            duplicates, conflicts = self._stored_already(group_ids, summary.column("prompt_id").to_pylist(),
                                                         expected_model)
            skipped = np.fromiter((g in duplicates or g in conflicts for g in group_ids), bool, len(group_ids))
            fresh = summary.filter(pa.array(~skipped))
            file_id = catalog.next_file_id
            first_seq = catalog.next_seq
            indexed = now_us()
            fresh = fresh.append_column("seq", pa.array(np.arange(first_seq, first_seq + fresh.num_rows, dtype=np.int64)))
            fresh = fresh.append_column("file_id", pa.array(np.full(fresh.num_rows, file_id, np.int32)))
            fresh = fresh.append_column("indexed_us", pa.array(np.full(fresh.num_rows, indexed, np.int64)))
            with catalog.transaction() as con:
                con.execute(
                    "INSERT INTO files VALUES (?, ?, 'rollouts', ?, ?, ?, ?, ?, ?, ?, NULL)",
                    [file_id, rel, expected_model, int(summary.column("num_rows").to_numpy().sum()), stat.st_size,
                     int(stat.st_mtime * 1e6), indexed, fresh.num_rows, len(duplicates) + len(conflicts)],
                )
                if fresh.num_rows:
                    con.register("fresh_groups", fresh)
                    con.execute("""
                        INSERT INTO groups SELECT group_id, seq, prompt_id, dataset, model_id, model_revision,
                            tokenizer_id, policy_step, group_size, successes, scored, reward_sum, mean_reward,
                            min_reward, max_reward, created_us, file_id, row_start, num_rows, indexed_us, has_mu
                        FROM fresh_groups""")
                    con.unregister("fresh_groups")
                if duplicates or conflicts:
                    con.executemany("INSERT INTO duplicates VALUES (?, ?, ?, ?)",
                                    [[g, rel, indexed, g in conflicts] for g in itertools.chain(duplicates, conflicts)])
            catalog.add_file(rel, file_id, groups=fresh.num_rows)
            self._add_to_mirror(fresh, rel)
            catalog.last_ingest_us = indexed
            if duplicates:
                log.warning("shard %s: %d of %d groups already indexed, kept the first copy and skipped these "
                            "(first few: %s)", rel, len(duplicates), len(group_ids), ", ".join(list(duplicates)[:5]))
            if conflicts:
                log.error("shard %s: skipped %s", rel, GroupConflict(conflicts))
            if duplicates or conflicts:
                # readers of the manifest must not count the skipped groups: the file leaves the live set
                if fresh.num_rows:
                    self.compaction.compact_files(expected_model, [file_id])
                else:
                    self.compaction.retire([file_id])
        log.debug("indexed %s: %d groups", rel, fresh.num_rows)
        return fresh.num_rows

    def _stored_already(self, group_ids: list[str], prompt_ids: list[str],
                        model: str) -> tuple[dict[str, GroupRef], dict[str, GroupRef]]:
        """Of these groups (of `model`), those stored already: as duplicates (the same model and prompt) and as
        conflicts (another model or prompt), each with the stored group's GroupRef."""
        duplicates: dict[str, GroupRef] = {}
        conflicts: dict[str, GroupRef] = {}
        for gid, prompt in zip(group_ids, prompt_ids):
            ref = self.catalog.mirror.get(gid)
            if ref is not None:
                (duplicates if (ref.model_id, ref.prompt_id) == (model, prompt) else conflicts)[gid] = ref
        return duplicates, conflicts

    def _add_to_mirror(self, fresh: pa.Table, rel: str) -> None:
        columns = [fresh.column(name).to_pylist() for name in (
            "group_id", "prompt_id", "model_id", "policy_step", "created_us", "successes", "group_size", "seq")]
        locations = [fresh.column(name).to_pylist() for name in ("row_start", "num_rows", "has_mu")]
        self.catalog.mirror.add(list(map(GroupRef._make, zip(*columns, itertools.repeat(rel), *locations))))

    def ingest_problem_file(self, path: Path) -> int:
        """Index a problems file of one dataset, each problem checked as a push's are: (dataset, prompt id)
        pairs, first copy wins. Quarantined if unreadable or invalid."""
        catalog = self.catalog
        rel = path.relative_to(catalog.root).as_posix()
        if catalog.knows(rel):
            return 0
        try:
            problems = validate_problems(pq.read_table(path), dataset=path.parent.name.removeprefix("dataset="))
            stat = path.stat()
        except (OSError, pa.ArrowException, ShardValidationError) as exc:
            catalog.quarantine(rel, str(exc))
            return 0
        with catalog.write_lock:
            if catalog.knows(rel):
                return 0
            pairs = [(p.dataset, p.prompt_id) for p in problems]
            fresh = list(dict.fromkeys(pair for pair in pairs if pair not in self._known_problems))
            file_id = catalog.next_file_id
            with catalog.transaction() as con:
                con.execute(
                    "INSERT INTO files VALUES (?, ?, 'prompts', NULL, ?, ?, ?, ?, ?, ?, NULL)",
                    [file_id, rel, len(problems), stat.st_size, int(stat.st_mtime * 1e6), now_us(), len(fresh),
                     len(pairs) - len(fresh)],
                )
                if fresh:
                    con.executemany("INSERT INTO problems VALUES (?, ?, ?)", [[d, p, file_id] for d, p in fresh])
            catalog.add_file(rel, file_id)
            self._known_problems.update(fresh)
        return len(fresh)

    # ------------------------------------------------------------------ push ingest

    def push(self, table: pa.Table, problems: list[Problem]) -> tuple[int, list[str], str | None]:
        """Write validated groups of one model as a shard and index it at once; then the problems.

        Returns (groups accepted, duplicate group ids not written, shard path relative to the root). Raises
        GroupConflict, writing nothing, if a group id is stored already under another model or prompt.
        """
        starts, lengths = group_runs(table.column("group_id"))
        heads = table.select(["group_id", "prompt_id", "model_id"]).take(pa.array(starts))
        model = heads.column("model_id")[0].as_py()
        with self.catalog.write_lock:
            duplicates, conflicts = self._stored_already(heads.column("group_id").to_pylist(),
                                                         heads.column("prompt_id").to_pylist(), model)
            if conflicts:
                raise GroupConflict(conflicts)
            shard = None
            accepted = 0
            if duplicates:
                keep = pc.invert(pc.is_in(table.column("group_id"), pa.array(list(duplicates), pa.string())))
                table = table.filter(keep)
                starts, lengths = group_runs(table.column("group_id"))
            if table.num_rows:
                path = write_rollout_table(model_dir(self.catalog.root, model), table)
                accepted = self.ingest_file(path, summary=summarise_groups(table, starts, lengths))
                shard = path.relative_to(self.catalog.root).as_posix()
            new_problems = self.add_problems(problems)
            if shard is not None or new_problems:
                self.catalog.write_manifest()  # before the push is acknowledged
            return accepted, list(duplicates), shard

    def add_problems(self, problems: list[Problem]) -> bool:
        """Write and index, as a problems file per dataset, the problems the store does not hold yet (by dataset
        and prompt id; first copy wins); whether there were any."""
        with self.catalog.write_lock:
            fresh = [p for p in problems if (p.dataset, p.prompt_id) not in self._known_problems]
            for path in write_problems(self.catalog.root, fresh) if fresh else ():
                self.ingest_problem_file(path)
            return bool(fresh)
