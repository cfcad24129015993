"""A store replica of a lake (`graft-store serve --backend lake`): it uses a local index over a cache of the lake.

The replica's root is a local store (shards, lookup files, index.duckdb) that only the replica writes, through
its `StoreIndex` (`replica.index`, which answers lookups and pages): the ingest loop's `poll` follows the lake
instead of scanning for shards. Each time, it reads the groups committed in the
snapshots after the one its cache holds (in commit order, so every replica keeps the same copy of a group
committed twice and indexes groups in the same order), writes them as cache shards of one snapshot and model
each (a writer's data file, which holds exactly that, is kept as it is), indexes them, and records the
snapshot in the index. Lookups are then answered exactly as on the
local backend, at the same cost, and two replicas that have read the same snapshot answer the same lookup
identically. A new replica, or one whose cache was deleted, reads the whole lake; `graft-store rebuild
--backend lake` starts the cache afresh.

Pushes (POST /v1/groups) commit to the lake in one transaction and are read back at once. When the lake
cannot be reached the replica keeps serving its cache, says why in /v1/stats and tries again on the next
poll. A snapshot whose data cannot be read or does not validate (a corrupt data file, a problem row a plain
writer made that the store's rules refuse) is set aside with the reason, listed in /v1/stats, retried every
lake_retry_unreadable_s, and does not stop the snapshots after it; any other error of a poll is said in
/v1/stats (lake.error) until a poll succeeds. A group the cache holds already, met again in a later commit,
is counted in /v1/stats (duplicate_groups, or conflicting_groups under another model or prompt) and logged.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from graft.schemas import PROBLEM_ARROW_SCHEMA, LakeStats, Problem, StatsResponse
from graft.services.store_api.broker import Broker
from graft.services.store_api.lake.config import LakeConfig, LakeError, LakeUnavailable, redact
from graft.services.store_api.lake.journal import LakeJournal
from graft.services.store_api.lake.lake import Lake
from graft.services.store_api.lake.reading import ROLLOUT_ROWS_SCHEMA, AddedRows, Snapshot, first_copies, next_window
from graft.services.store_api.local import (
    StoreIndex,
    model_dir,
    now_us,
    row_group_plan,
    summarise_groups,
    us_to_datetime,
    write_rollout_table,
)
from graft.services.store_api.settings import StoreSettings
from graft.services.store_api.tables import ShardValidationError, group_runs, validate_problems, validate_table

log = logging.getLogger("graft.store.replica")

WINDOW_ROWS = 16384  # about this many rollouts read from the lake at a time (bounds the replica's memory)
CACHE_SHARD_ROWS = 8192  # rollouts per cache shard, whole groups
ERROR_LOG_INTERVAL_S = 60.0  # the same follow error is logged again after this long, not every poll
# what makes a snapshot's data unreadable (set aside and retried; the snapshots after it are read): a damaged
# file, or rows the store's rules refuse (a plain DuckDB writer's)
UNREADABLE = (LakeError, ShardValidationError, pa.ArrowException)


class LakeReplica:
    """The lake of `settings.lake_catalog`, followed into the local index of `settings.root` (the cache)."""

    def __init__(self, settings: StoreSettings):
        self.settings = settings
        self.index = StoreIndex(settings)  # the cache's: lookups, pages and stats are answered from it
        self.lake = Lake(LakeConfig.of_replica(settings))
        # wanted prompts and the served ledger, in the lake: every replica's (lake/journal.py)
        self.broker = Broker(LakeJournal(self.lake), settings.max_wanted, settings.wanted_within_steps)
        self.followed = -1  # the newest snapshot whose groups the cache holds (-1: none read)
        self.followed_time_us: int | None = None
        self.newest: Snapshot | None = None  # the lake's newest snapshot when last looked
        self.checked_us: int | None = None
        self.error: str | None = None
        self.unreadable: dict[int, str] = {}  # snapshot id -> why its data could not be read
        self._unreadable_tried = 0.0
        self._logged: tuple[str, float] | None = None
        self._follow_lock = threading.Lock()

    # ------------------------------------------------------------------ opening

    def open(self) -> LakeReplica:
        """Open the cache's index, then catch up with the lake. A lake that cannot be reached is an error when
        the cache is empty (nothing to serve), else the replica serves its cache and keeps trying."""
        self.index.load()
        self._load_follow_state()
        try:
            self.lake.open()
        except LakeUnavailable as exc:
            if not len(self.index.catalog.mirror):
                raise
            self._failed(exc)
        else:
            self.follow()
            if self.error and not len(self.index.catalog.mirror) and self.followed < 0:
                raise LakeError(self.error)
        self.index.catalog.write_manifest()  # the cache's live files, as a local store's (manifest.py)
        self.index.ingest.delete_orphan_lookup_files()
        try:
            self.broker.open(self.index.queries)
        except LakeUnavailable as exc:  # the first poll that reaches the lake reads the journal (read_new from the start)
            log.warning("the lake's broker journal cannot be read now (%s): wanted prompts and the ledger start empty "
                        "here until the lake answers", exc)
        return self

    def _load_follow_state(self) -> None:
        meta = self.index.catalog.meta("lake_")
        identity = self.lake.config.describe()
        if meta.get("lake_identity") not in (None, identity):
            log.warning("cache %s held lake %s, this replica follows %s: starting the cache afresh",
                        self.index.catalog.root, meta["lake_identity"], identity)
            self._clear_cache()
            meta = {}
        self.index.catalog.set_meta("lake_identity", identity)
        self.followed = int(meta.get("lake_snapshot", -1))
        self.followed_time_us = int(meta["lake_snapshot_time_us"]) if meta.get("lake_snapshot_time_us") else None
        self.unreadable = {int(s): "not read yet since the restart" for s in
                           (meta.get("lake_unreadable") or "").split(",") if s}

    def _clear_cache(self) -> None:
        """An empty cache (the lake holds it all), followed from the start."""
        self.index.clear()
        self.followed, self.followed_time_us, self.unreadable = -1, None, {}

    def rebuild(self) -> int:
        """Start the cache afresh and read the whole lake into it (stop the server first); groups cached."""
        self._clear_cache()  # opens the index if it is not: takes its file lock, or raises IndexLocked
        self.index.catalog.set_meta("lake_identity", self.lake.config.describe())
        self.lake.open()
        self.follow()
        if self.error:
            raise LakeError(self.error)
        return len(self.index.catalog.mirror)

    def close(self) -> None:
        self.broker.close()
        self.index.close()
        self.lake.close()

    # ------------------------------------------------------------------ following the lake

    def poll(self) -> int:
        """The ingest loop's call: follow the lake (the cache has no other writer to scan for), then clear the wants
        the new groups serve."""
        added = self.follow()
        try:
            self.broker.clear_landed(self.index.queries)
        except LakeError as exc:  # follow() reports the outage; the broker catches up at the next poll that gets through
            log.debug("the broker could not follow the lake: %s", exc)
        return added

    def follow(self) -> int:
        """Read the snapshots newer than the cache's into the cache; return the groups added."""
        with self._follow_lock:
            added = 0
            try:
                newest = self.lake.reading.snapshot()
                self.newest, self.checked_us = newest, now_us()
                if newest.id > self.followed:
                    added += self._read(self.followed, newest.id)
                    self.followed_time_us = newest.time_us
                    self.index.catalog.set_meta("lake_snapshot_time_us", str(newest.time_us))
                retry_due = time.monotonic() - self._unreadable_tried >= self.settings.lake_retry_unreadable_s
                if self.unreadable and retry_due:
                    added += self._retry_unreadable()
            except Exception as exc:  # noqa: BLE001 - unreachable, failing as a whole, or the cache's own trouble
                # (a full disk): serve the cache, say why in /v1/stats, try again next poll
                self._failed(exc)
                return added
            finally:
                if added:
                    self.index.catalog.write_manifest()
            self.error = None
            return added

    def _read(self, after: int, upto: int) -> int:
        """Snapshots after+1..upto in windows of about WINDOW_ROWS rollouts; a window that fails to read is read
        again one snapshot at a time, and a snapshot that still fails is set aside."""
        added, width = 0, 1  # grows while windows are small: a backlog of big commits never comes at once
        while after < upto:
            end = min(upto, after + width)
            try:
                added_rows, problems = self._read_window(after, end)
                added += self._ingest(added_rows, problems)
            except LakeUnavailable:
                raise
            except UNREADABLE as exc:
                if end - after > 1:
                    width = 1
                    continue
                self._set_aside(end, exc)
                added_rows = None
            self._advance(end)
            after = end
            if added_rows is not None:
                width = next_window(width, added_rows.rows.num_rows, WINDOW_ROWS)
        return added

    def _read_window(self, after: int, upto: int) -> tuple[AddedRows, pa.Table]:
        """The rollouts and problems committed in snapshots after+1..upto; a table those snapshots did not insert
        into is not read (a commit need not carry problems, and compaction makes snapshots too)."""
        inserted = self.lake.reading.tables_inserted_into(after, upto)
        added_rows = (self.lake.reading.rollouts_added(after, upto) if inserted is None or "rollouts" in inserted
                      else AddedRows(ROLLOUT_ROWS_SCHEMA.empty_table(), {}))
        problems = (self.lake.reading.problems_between(after, upto) if inserted is None or "problems" in inserted
                    else PROBLEM_ARROW_SCHEMA.empty_table())
        return added_rows, problems

    def _retry_unreadable(self) -> int:
        self._unreadable_tried = time.monotonic()
        self.lake.connection.reset()  # a fresh DuckDB instance: nothing of the damaged files stays in its caches
        added = 0
        for snapshot in sorted(self.unreadable):
            try:
                added_rows, problems = self._read_window(snapshot - 1, snapshot)
                added += self._ingest(added_rows, problems)
            except LakeUnavailable:
                raise
            except UNREADABLE as exc:
                self.unreadable[snapshot] = _reason(exc)
                continue
            log.info("lake snapshot %d is readable again: %d groups cached", snapshot, added)
            del self.unreadable[snapshot]
        self.index.catalog.set_meta("lake_unreadable", ",".join(map(str, sorted(self.unreadable))))
        return added

    def _set_aside(self, snapshot: int, exc: BaseException) -> None:
        self.unreadable[snapshot] = _reason(exc)
        self.index.catalog.set_meta("lake_unreadable", ",".join(map(str, sorted(self.unreadable))))
        log.error("lake snapshot %d cannot be read into the cache (its groups are missing here until it can; "
                  "retried every %.0f s): %s", snapshot, self.settings.lake_retry_unreadable_s,
                  self.unreadable[snapshot])

    def _advance(self, snapshot: int) -> None:
        self.followed = snapshot
        self.index.catalog.set_meta("lake_snapshot", str(snapshot))

    def _failed(self, exc: BaseException) -> None:
        self.error = _reason(exc) if isinstance(exc, LakeError) else f"{type(exc).__name__}: {_reason(exc)}"
        now = time.monotonic()
        if self._logged is None or self._logged[0] != self.error or now - self._logged[1] >= ERROR_LOG_INTERVAL_S:
            # an error not the lake's (the cache's disk, a bug) is logged with where it came from
            log.error("cannot follow the lake (serving the cache, snapshot %d; trying again every poll): %s",
                      self.followed, self.error, exc_info=not isinstance(exc, LakeError))
            self._logged = (self.error, now)

    def _ingest(self, window: AddedRows, problems: pa.Table) -> int:
        """Cache the groups of lake rows (commit order) not cached yet, the first copy of each; and problems. Other
        copies (writers racing with one group id, plain SQL inserts) are counted and logged (`_count_copies`).

        Cache shards hold one snapshot's groups of one model, indexed in commit order: the order groups are
        indexed in (which GET /v1/rollouts pages by) is then the lake's, whatever windows a replica read. Where
        those rows are exactly one data file of `window.bodies` (a commit of graft's writers holds one file per
        model), the file's bytes are the shard (encoding the rows again cost ~8 us per rollout).
        """
        self.index.ingest.add_problems(validate_problems(problems))  # a row a plain writer made may be refused
        rows, left_out = first_copies(window.rows, self.index.catalog.mirror)
        if left_out.num_rows:
            self._count_copies(left_out, rows)
        if not rows.num_rows:
            return 0
        snapshot_ids = rows.column("snapshot_id").to_numpy()  # (rows,) ascending
        row_ids = rows.column("rowid").to_numpy()  # (rows,) ascending within a snapshot
        table = validate_table(rows.drop_columns(["rowid", "snapshot_id"]))
        bounds = [0, *(np.flatnonzero(np.diff(snapshot_ids)) + 1).tolist(), table.num_rows]
        added = 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            snapshot = table.slice(start, end - start)
            models = pc.unique(snapshot.column("model_id")).to_pylist()
            for model in models:
                of_model, row_ids_of_model = snapshot, row_ids[start:end]
                if len(models) > 1:
                    is_model = pc.equal(snapshot.column("model_id"), model)
                    of_model = snapshot.filter(is_model)
                    row_ids_of_model = row_ids_of_model[is_model.to_numpy(zero_copy_only=False)]
                group_starts, group_lengths = group_runs(of_model.column("group_id"))
                encoded = _whole_file(window.bodies, row_ids_of_model)
                if encoded is not None:
                    path = write_rollout_table(model_dir(self.index.catalog.root, model), of_model, encoded=encoded)
                    summary = summarise_groups(of_model, group_starts, group_lengths)
                    added += self.index.ingest.ingest_file(path, summary)
                    continue
                offset = 0
                for rows_in_shard in row_group_plan(group_lengths, CACHE_SHARD_ROWS):
                    shard = of_model.slice(offset, rows_in_shard)
                    in_shard = (group_starts >= offset) & (group_starts < offset + rows_in_shard)
                    path = write_rollout_table(model_dir(self.index.catalog.root, model), shard)
                    # the rows were validated just above: the index takes their summary instead of decoding the
                    # shard's small columns again (what a push does)
                    summary = summarise_groups(shard, group_starts[in_shard] - offset, group_lengths[in_shard])
                    added += self.index.ingest.ingest_file(path, summary)
                    offset += rows_in_shard
        self.index.catalog.last_ingest_us = now_us()
        return added

    def _count_copies(self, left_out: pa.Table, kept: pa.Table) -> None:
        """Record the copies of groups held already (their first rows, `left_out`) as the local store records a
        shard's: in the index's duplicates (a conflict when under another model or prompt), shown in /v1/stats,
        and logged. Idempotent per (group, snapshot): a snapshot read again adds nothing."""
        starts, _ = group_runs(kept.column("group_id"))
        heads = kept.select(["group_id", "model_id", "prompt_id"]).take(pa.array(starts))
        firsts = {g: (m, p) for g, m, p in zip(*(heads.column(n).to_pylist() for n in heads.column_names))}
        seen = now_us()
        copies = []
        for gid, model, prompt, snapshot in zip(*(left_out.column(n).to_pylist() for n in (
                "group_id", "model_id", "prompt_id", "snapshot_id"))):
            ref = self.index.catalog.mirror.get(gid)
            stored = (ref.model_id, ref.prompt_id) if ref is not None else firsts[gid]
            copies.append((gid, f"lake snapshot {snapshot}", seen, stored != (model, prompt), stored))
        self.index.catalog.record_duplicates([c[:4] for c in copies])
        for gid, where, _, conflict, (model, prompt) in copies:
            if conflict:
                log.error("%s holds group %s again under another model or prompt (stored for model %s, prompt %s): "
                          "the cache keeps the first copy; give one of them a new id", where, gid, model, prompt)
        duplicates = [c[0] for c in copies if not c[3]]
        if duplicates:
            log.warning("%d groups were committed to the lake more than once; the cache keeps the first copy "
                        "(first few: %s)", len(duplicates), ", ".join(duplicates[:5]))

    # ------------------------------------------------------------------ writes and stats

    def push(self, table: pa.Table, problems: list[Problem]) -> tuple[int, list[str], str | None]:
        """Commit validated groups to the lake in one transaction, then read them into the cache at once."""
        result = self.lake.writing.commit(table, problems)
        self.follow()
        return result.accepted_groups, result.duplicate_groups, None

    def stats(self) -> StatsResponse:
        stats = self.index.queries.stats()
        age = None if self.followed_time_us is None else round((now_us() - self.followed_time_us) / 1e6, 3)
        stats.backend = "lake"
        stats.broker = self.broker.stats()
        stats.lake = LakeStats(
            catalog=redact(self.lake.config.catalog), data_path=self.lake.connection.data_path,
            snapshot_id=None if self.followed < 0 else self.followed,
            snapshot_at=us_to_datetime(self.followed_time_us), snapshot_age_s=age,
            newest_snapshot_id=None if self.newest is None else self.newest.id,
            checked_at=us_to_datetime(self.checked_us), error=self.error, unreadable_snapshots=sorted(self.unreadable),
        )
        return stats


def _whole_file(bodies: dict[int, tuple[int, bytes]], row_ids: np.ndarray) -> bytes | None:
    """The bytes of the data file whose rows are exactly those of `row_ids` (ascending, unique), if there is one."""
    if not len(row_ids):
        return None
    rows, body = bodies.get(int(row_ids[0]), (0, None))
    return body if rows == len(row_ids) and int(row_ids[-1] - row_ids[0]) == rows - 1 else None


def _reason(exc: BaseException) -> str:
    return redact(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)

