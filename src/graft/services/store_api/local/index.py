"""The store's index: which groups are stored where, answered fast; `StoreIndex` is what the app and CLI use.

The Parquet files are the source of truth: `rebuild()` recreates the index from them alone, and the reader
rebuilds any missing or damaged lookup file from its shard. `StoreIndex` holds four parts, each an object that
owns its state and calls the others' public methods (none inherits from another):

- `catalog` (catalog.py): the DuckDB connection and its write lock, the tables, opening, reconciling with the
  disk, the mirror (`mirror.py`: the in-memory copy of the groups table that lookups are answered from) and
  the indexed files' paths, quarantine, the readers' manifest (`manifest.py`), closing;
- `compaction` (compaction.py): merging small shards and deleting retired ones; owns the compaction lock and
  the batches that failed;
- `ingest` (ingest.py): new files in (scanning, checking and indexing shards and problem files, pushes,
  cleaning up after writers); owns the problems indexed; rewrites a shard with skipped groups through
  `compaction`;
- `queries` (queries.py): what the API asks (lookups, filtered rollout pages, stats) and reading the chosen rows.

`StoreIndex` assembles them, keeps their lifecycle (open, load, clear, rebuild, close) and hands them out, as
DuckDB's instance hands out its managers: callers call the part that does the work (`index.queries.stats()`,
`index.ingest.push(...)`, `index.catalog.mirror`), so "go to definition" lands on it. No method here only passes
its arguments on to a part (tests/layout/test_store.py checks).

`store_backend` (services/store_api/backend.py) picks the store behind the API and the CLI: this index, or a
lake replica (`lake/replica.py`), which uses an index of its own over its cache.
"""

from __future__ import annotations

from graft.services.store_api.local.catalog import Catalog
from graft.services.store_api.local.compaction import IndexCompaction
from graft.services.store_api.local.ingest import IndexIngest
from graft.services.store_api.local.queries import IndexQueries
from graft.services.store_api.settings import StoreSettings


class StoreIndex:
    """The index of one store root; thread-safe; the only opener of `<root>/index.duckdb`."""

    def __init__(self, settings: StoreSettings):
        self.settings = settings
        self.catalog = Catalog(settings)
        self.compaction = IndexCompaction(self.catalog)
        self.ingest = IndexIngest(self.catalog, self.compaction)
        self.queries = IndexQueries(self.catalog)

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> StoreIndex:
        """Open (or create) the index, reconcile it with the files on disk, load the mirror, index new files."""
        self.load()
        self.ingest.ingest_new()
        self.catalog.write_manifest()  # what the index holds now, whatever a crash left in the old one
        self.ingest.delete_orphan_lookup_files()
        return self

    def load(self) -> StoreIndex:
        """Open (or create) the index, reconcile it with the files on disk and load the mirror; index no new files
        (a lake replica's cache has no writer but its replica)."""
        self.catalog.connect()
        self.catalog.reconcile()
        self.catalog.load_mirror()
        self.ingest.load()
        return self

    def clear(self) -> None:
        """Empty the store: no shards, lookup files, problems or index entries (a lake replica's cache starting
        afresh). Opens the index first if it is not open (its file lock, or IndexLocked)."""
        with self.catalog.write_lock:
            self.catalog.clear_files()
            self.ingest.load()

    def recreate(self) -> None:
        """Drop every table and start an empty index (`rebuild` then ingests the files anew)."""
        with self.catalog.write_lock:
            self.catalog.recreate()
            self.ingest.load()

    def rebuild(self) -> int:
        """Recreate the index from the Parquet files alone; return the number of groups indexed."""
        with self.catalog.write_lock:
            self.recreate()
            self.ingest.ingest_new()
            self.catalog.write_manifest()
            return len(self.catalog.mirror)

    def close(self) -> None:
        self.catalog.close()
