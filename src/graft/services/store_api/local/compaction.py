"""Compaction: merging a model's small shards into files sorted by prompt id, swapped into the index
atomically, and deleting retired shards once no read can still hold them: a part of `StoreIndex` (index.py),
working through the catalog's methods.

A batch that fails is not retried in a loop: an unreadable shard is quarantined, any other error is logged
once and that same batch skipped until its files change.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from graft.services.store_api.local.catalog import Catalog
from graft.services.store_api.local.durable import publish
from graft.services.store_api.local.lookup import ShardReadError
from graft.services.store_api.local.mirror import now_us
from graft.services.store_api.local.shards import ROW_GROUP_ROWS, discard, model_dir, write_rollout_table
from graft.services.store_api.tables import group_runs

log = logging.getLogger("graft.store")


class IndexCompaction:
    """The maintenance side of StoreIndex: compaction and deleting retired shards. Owns the compaction lock and
    the batches that failed; ingest uses `compact_files` and `retire` for a shard it indexed with skipped groups."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self._compact_lock = threading.Lock()
        self._failed_batches: set[tuple[str, frozenset[int]]] = set()  # batches not to retry as they are

    def compact(self, model_id: str | None = None, min_files: int | None = None) -> dict[str, int]:
        """Merge small shards of each model into files sorted by prompt id; swap them in atomically.

        Returns counts: files_merged, files_written, groups_moved, files_retired_empty.
        """
        catalog, settings = self.catalog, self.catalog.settings
        min_files = settings.compact_min_files if min_files is None else min_files
        report = {"files_merged": 0, "files_written": 0, "groups_moved": 0, "files_retired_empty": 0}
        with self._compact_lock:
            candidates = catalog.cursor().execute("""
                SELECT f.file_id, f.path, f.model_id, coalesce(live.rows, 0) AS live_rows
                FROM files f LEFT JOIN (SELECT file_id, sum(num_rows) AS rows FROM groups GROUP BY file_id) live
                    USING (file_id)
                WHERE f.kind = 'rollouts' AND f.retired_us IS NULL AND coalesce(live.rows, 0) < ?
                    AND (? IS NULL OR f.model_id = ?)
                ORDER BY f.model_id, f.path""", [settings.compact_small_rows, model_id, model_id]).fetchall()
            by_model: dict[str, list[tuple[int, str, int]]] = {}
            for file_id, rel, model, live_rows in candidates:
                if live_rows == 0:
                    self.retire([file_id])
                    report["files_retired_empty"] += 1
                else:
                    by_model.setdefault(model, []).append((file_id, rel, live_rows))
            for model, files in by_model.items():
                if len(files) < min_files:
                    continue
                batch: list[tuple[int, str, int]] = []
                rows = 0
                for item in files + [None]:
                    if item is not None and (not batch or rows + item[2] <= settings.compact_target_rows):
                        batch.append(item)
                        rows += item[2]
                        continue
                    if len(batch) >= 2:
                        moved = self._compact_batch_once(model, [b[0] for b in batch])
                        if moved:
                            report["files_merged"] += len(batch)
                            report["files_written"] += 1
                            report["groups_moved"] += moved
                    batch, rows = ([item], item[2]) if item is not None else ([], 0)
        return report

    def _compact_batch_once(self, model: str, file_ids: list[int]) -> int:
        """`compact_files`, unless this very batch failed before; a failure never propagates into a loop."""
        key = (model, frozenset(file_ids))
        if key in self._failed_batches:
            return 0
        try:
            return self.compact_files(model, file_ids)
        except ShardReadError as exc:
            rel = exc.path.relative_to(self.catalog.root).as_posix()
            if exc.path.exists():  # else compacted or quarantined meanwhile: the next round sees the new state
                self.catalog.quarantine(rel, f"unreadable at compaction: {exc.reason}")
            return 0
        except Exception:
            self._failed_batches.add(key)
            log.exception("compacting %d shards of %s failed; this batch is skipped until its files change",
                          len(file_ids), model)
            return 0

    def compact_files(self, model: str, file_ids: list[int]) -> int:
        """Rewrite these live shards of `model` as one file sorted by prompt id and swap it in (ingest also uses it
        to drop a shard's skipped groups); the number of groups moved (0 when a shard of them left meanwhile)."""
        catalog = self.catalog
        placeholders = ", ".join("?" * len(file_ids))
        rows = catalog.cursor().execute(f"""
            SELECT g.group_id, f.path, g.row_start, g.num_rows FROM groups g JOIN files f USING (file_id)
            WHERE g.file_id IN ({placeholders}) ORDER BY f.path, g.row_start""", file_ids).fetchall()
        if not rows:
            return 0
        table = catalog.reader.read([(path, start, n) for _, path, start, n in rows])
        order = pc.sort_indices(
            table.select(["prompt_id", "group_id"]).append_column("position", pa.array(np.arange(table.num_rows))),
            sort_keys=[("prompt_id", "ascending"), ("group_id", "ascending"), ("position", "ascending")],
        )
        table = table.take(order)
        starts, lengths = group_runs(table.column("group_id"))
        tmp = write_rollout_table(model_dir(catalog.root, model), table, ROW_GROUP_ROWS, publish_now=False)
        moved_ids = table.column("group_id").take(pa.array(starts)).to_pylist()
        with catalog.write_lock:
            live = catalog.execute(f"SELECT count(*) FROM groups WHERE file_id IN ({placeholders})", file_ids)[0][0]
            if live != len(rows):  # a shard of the batch was quarantined meanwhile: try again next time
                discard(tmp)
                return 0
            final = publish(tmp)
            rel = final.relative_to(catalog.root).as_posix()
            file_id = catalog.next_file_id
            stamp = now_us()
            locations = pa.table({"group_id": moved_ids, "row_start": pa.array(starts)})
            try:
                with catalog.transaction() as con:
                    con.execute(
                        "INSERT INTO files VALUES (?, ?, 'rollouts', ?, ?, ?, ?, ?, ?, 0, NULL)",
                        [file_id, rel, model, table.num_rows, final.stat().st_size, stamp, stamp, len(moved_ids)],
                    )
                    con.register("new_locations", locations)
                    con.execute("""UPDATE groups SET file_id = ?, row_start = n.row_start
                                   FROM new_locations n WHERE groups.group_id = n.group_id""", [file_id])
                    con.unregister("new_locations")
                    con.execute(f"UPDATE files SET retired_us = ? WHERE file_id IN ({placeholders})",
                                [stamp, *file_ids])
            except BaseException:
                discard(final)  # rolled back: the new file is in no table
                raise
            catalog.add_file(rel, file_id)
            catalog.mirror.relocate(moved_ids, starts.tolist(), rel)
            catalog.write_manifest()
        log.info("compacted %d shards of %s into %s (%d groups, %d rows)", len(file_ids), model, rel,
                 len(moved_ids), table.num_rows)
        return len(moved_ids)

    def retire(self, file_ids: list[int]) -> None:
        """Take these files out of the live set (deleted by `delete_retired` once no read can hold them)."""
        with self.catalog.write_lock:
            placeholders = ", ".join("?" * len(file_ids))
            self.catalog.execute(f"UPDATE files SET retired_us = ? WHERE file_id IN ({placeholders})",
                                 [now_us(), *file_ids])
            self.catalog.write_manifest()

    def delete_retired(self, grace_s: float | None = None) -> int:
        """Delete shards retired more than `grace_s` ago (in-flight reads of them have finished)."""
        catalog = self.catalog
        grace_s = catalog.settings.retired_grace_s if grace_s is None else grace_s
        with catalog.write_lock:
            rows = catalog.execute("SELECT file_id, path FROM files WHERE retired_us <= ?",
                                   [now_us() - int(grace_s * 1e6)])
            for file_id, rel in rows:
                catalog.reader.forget(rel)
                (catalog.root / rel).unlink(missing_ok=True)
                catalog.execute("DELETE FROM files WHERE file_id = ?", [file_id])
                catalog.forget_file(rel)
        return len(rows)
