"""The store's index: which groups are stored where, answered fast; `StoreIndex` is what the app and CLI use.

The Parquet files are the source of truth: `rebuild()` recreates the index from them alone, and the reader
rebuilds any missing or damaged lookup file from its shard. `StoreIndex` is one object made of parts that
each own one job, all on the state of `Catalog`:

- `catalog.py`: the DuckDB tables, opening, reconciling with the disk, quarantine, closing;
- `mirror.py`: the in-memory copy of the groups table that peer, prompt and group lookups are answered from;
- `ingest.py`: new files in (scanning, checking and indexing shards and problem files, pushes, cleaning up
  after writers);
- `queries.py`: what the API asks (lookups, filtered rollout pages, stats) and reading the chosen rows;
- `compaction.py`: merging small shards and deleting retired ones;
- `manifest.py`: the live files for outside readers, rewritten whenever the set changes.

`http/backend.store_backend` picks the store behind the API and the CLI: this index, or a lake replica
(`lake/replica.py`), which uses an index of its own over its cache.
"""

from __future__ import annotations

import shutil

from services.store_api.local.compaction import IndexCompaction
from services.store_api.local.ingest import IndexIngest
from services.store_api.local.lookup import ShardReader
from services.store_api.local.queries import IndexQueries


class StoreIndex(IndexIngest, IndexQueries, IndexCompaction):
    """The index of one store root; thread-safe; the only opener of `<root>/index.duckdb`."""

    def open(self) -> StoreIndex:
        """Open (or create) the index, reconcile it with the files on disk, load the mirror, index new files."""
        self.load()
        self.ingest_new()
        self.write_manifest()  # what the index holds now, whatever a crash left in the old one
        self.delete_orphan_lookup_files()
        return self

    def load(self) -> StoreIndex:
        """Open (or create) the index, reconcile it with the files on disk and load the mirror; index no new files
        (a lake replica's cache has no writer but its replica)."""
        self._connect()
        self._reconcile()
        self._load_mirror()
        return self

    def clear(self) -> None:
        """Empty the store: no shards, lookup files, problems or index entries (a lake replica's cache starting
        afresh). Opens the index first if it is not open (its file lock, or IndexLocked)."""
        with self._write_lock:
            if self._con is None:
                self._connect()
            self.reader = ShardReader(self.root, self.settings.max_open_files)  # drops the open lookup files
            for sub in ("rollouts", "prompts", "lookup"):
                shutil.rmtree(self.root / sub, ignore_errors=True)
            self.recreate()
            for sub in ("rollouts", "prompts", "quarantine"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)

    def rebuild(self) -> int:
        """Recreate the index from the Parquet files alone; return the number of groups indexed."""
        with self._write_lock:
            self.recreate()
            self.ingest_new()
            self.write_manifest()
            return len(self.mirror)

