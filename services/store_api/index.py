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

`backend.store_backend` picks the store behind the API and the CLI: this index, or a lake replica (`replica.py`).
"""

from __future__ import annotations

from services.store_api.compaction import IndexCompaction
from services.store_api.ingest import IndexIngest
from services.store_api.queries import IndexQueries


class StoreIndex(IndexIngest, IndexQueries, IndexCompaction):
    """The index of one store root; thread-safe; the only opener of `<root>/index.duckdb`."""

    def open(self) -> StoreIndex:
        """Open (or create) the index, reconcile it with the files on disk, load the mirror, index new files."""
        self._connect()
        self._reconcile()
        self._load_mirror()
        self.ingest_new()
        self.write_manifest()  # what the index holds now, whatever a crash left in the old one
        self.delete_orphan_lookup_files()
        return self

    def rebuild(self) -> int:
        """Recreate the index from the Parquet files alone; return the number of groups indexed."""
        with self._write_lock:
            self.recreate()
            self.ingest_new()
            self.write_manifest()
            return len(self.mirror)

