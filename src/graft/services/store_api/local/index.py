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

`StoreIndex` only assembles them and keeps the one set of methods the API, the CLI, the browser and the lake
replica call; each passes to the part that does it.

`store_backend` (services/store_api/backend.py) picks the store behind the API and the CLI: this index, or a
lake replica (`lake/replica.py`), which uses an index of its own over its cache.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa

from graft.schemas import PeerLookupRequest, Problem, StatsResponse
from graft.services.store_api.local.catalog import Catalog
from graft.services.store_api.local.compaction import IndexCompaction
from graft.services.store_api.local.ingest import IndexIngest
from graft.services.store_api.local.lookup import ShardReader
from graft.services.store_api.local.mirror import GroupMirror, GroupRef
from graft.services.store_api.local.queries import IndexQueries
from graft.services.store_api.settings import StoreSettings


class StoreIndex:
    """The index of one store root; thread-safe; the only opener of `<root>/index.duckdb`."""

    def __init__(self, settings: StoreSettings):
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

    # ------------------------------------------------------------------ the catalog's state and its methods

    @property
    def settings(self) -> StoreSettings:
        return self.catalog.settings

    @property
    def root(self) -> Path:
        return self.catalog.root

    @property
    def path(self) -> Path:
        return self.catalog.path

    @property
    def reader(self) -> ShardReader:
        return self.catalog.reader

    @property
    def mirror(self) -> GroupMirror:
        return self.catalog.mirror

    @property
    def last_ingest_us(self) -> int | None:
        return self.catalog.last_ingest_us

    @last_ingest_us.setter
    def last_ingest_us(self, value: int | None) -> None:
        self.catalog.last_ingest_us = value

    def meta(self, prefix: str) -> dict[str, str]:
        return self.catalog.meta(prefix)

    def set_meta(self, key: str, value: str) -> None:
        self.catalog.set_meta(key, value)

    def record_duplicates(self, copies: list[tuple[str, str, int, bool]]) -> None:
        self.catalog.record_duplicates(copies)

    def write_manifest(self) -> None:
        self.catalog.write_manifest()

    def quarantine(self, rel: str, reason: str) -> None:
        self.catalog.quarantine(rel, reason)

    # ------------------------------------------------------------------ ingest's

    def scan(self) -> list[Path]:
        return self.ingest.scan()

    def ingest_new(self) -> int:
        return self.ingest.ingest_new()

    def ingest_file(self, path: Path, summary: pa.Table | None = None) -> int:
        return self.ingest.ingest_file(path, summary)

    def ingest_problem_file(self, path: Path) -> int:
        return self.ingest.ingest_problem_file(path)

    def push(self, table: pa.Table, problems: list[Problem]) -> tuple[int, list[str], str | None]:
        return self.ingest.push(table, problems)

    def add_problems(self, problems: list[Problem]) -> bool:
        return self.ingest.add_problems(problems)

    def delete_orphan_lookup_files(self) -> int:
        return self.ingest.delete_orphan_lookup_files()

    def open_lookup_files(self) -> None:
        self.ingest.open_lookup_files()

    # ------------------------------------------------------------------ compaction's

    def compact(self, model_id: str | None = None, min_files: int | None = None) -> dict[str, int]:
        return self.compaction.compact(model_id, min_files)

    def delete_retired(self, grace_s: float | None = None) -> int:
        return self.compaction.delete_retired(grace_s)

    # ------------------------------------------------------------------ the queries'

    def select_peer_groups(self, req: PeerLookupRequest,
                           served: Mapping[str, int] | None = None) -> tuple[list[GroupRef], dict[str, str]]:
        return self.queries.select_peer_groups(req, served)

    def select_prompt_groups(self, prompt: str, model: str | None, limit: int) -> list[GroupRef]:
        return self.queries.select_prompt_groups(prompt, model, limit)

    def select_group(self, group_id: str) -> list[GroupRef]:
        return self.queries.select_group(group_id)

    def read_selected(self, select, as_messages: bool = False):
        return self.queries.read_selected(select, as_messages)

    def group_count(self) -> int:
        return self.queries.group_count()

    @functools.wraps(IndexQueries.rollout_page)  # its keyword-only filters, said once (inspect shows them)
    def rollout_page(self, **filters) -> tuple[pa.Table, str | None]:
        return self.queries.rollout_page(**filters)

    def prompt_refs(self, prompt_id: str) -> list[GroupRef]:
        return self.queries.prompt_refs(prompt_id)

    def prompts_before(self, before: int, span: int) -> list[tuple[int, str, str]]:
        return self.queries.prompts_before(before, span)

    def newest_seq(self) -> int:
        return self.queries.newest_seq()

    def groups_after(self, seq: int) -> tuple[list[tuple[int, str, str]], int]:
        return self.queries.groups_after(seq)

    def problem_files(self) -> dict[int, str]:
        return self.queries.problem_files()

    def problems_of_file(self, file_id: int) -> set[tuple[str, str]]:
        return self.queries.problems_of_file(file_id)

    def step_bins(self, bins: int) -> tuple[int, list[tuple]]:
        return self.queries.step_bins(bins)

    def dataset_counts(self) -> list[tuple[str, int, int, int, int]]:
        return self.queries.dataset_counts()

    def stats(self) -> StatsResponse:
        return self.queries.stats()
