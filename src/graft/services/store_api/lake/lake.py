"""The store's DuckLake: rollouts and problems as DuckLake tables, DuckDB's extensions from PyPI wheels.

A lake is a SQL catalog (PostgreSQL for many hosts, SQLite for one) plus Parquet data files (S3-compatible
object storage or a shared path). `rollouts` and `problems` have the columns of ROLLOUT_ARROW_SCHEMA and
PROBLEM_ARROW_SCHEMA; `rollouts` is partitioned by model_id, like the local store's directories. Plain DuckDB
reads it with `ATTACH 'ducklake:<catalog>' AS lake` (docs/lake.md).

`Lake` is one handle on a lake that holds parts, each an object that owns its state and works through the
connection's public methods (none inherits from another):

- `config.py`: where the lake is (`LakeConfig`), its errors, DuckDB's lake extensions;
- `connection` (connection.py): attaching (and making the tables), the connection discipline, the data files'
  storage; owns the attach, its lock and the S3 client;
- `writing` (writing.py): committing whole groups and their problems in one transaction;
- `reading` (reading.py): reading what snapshot windows added, in commit order (what replicas follow); owns the
  newest snapshot read;
- `maintenance` (maintenance.py): DuckLake's merges, snapshot expiry and file cleanup.

`replica.py` serves a lake through the local index over a cache; `migrate.py` copies a store between a local
root and a lake.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Self

import duckdb
import pyarrow as pa

from graft.schemas import Problem
from graft.services.store_api.lake.config import LakeConfig
from graft.services.store_api.lake.connection import LakeConnection
from graft.services.store_api.lake.maintenance import LakeMaintenance
from graft.services.store_api.lake.reading import AddedRows, DataFile, LakeReading, Snapshot
from graft.services.store_api.lake.writing import LakeCommit, LakeWriting


class Lake:
    """One process's handle on a lake: attach, commit groups, follow snapshots, maintain. Thread-safe. Each
    method passes to the part that does it."""

    def __init__(self, config: LakeConfig, create: bool = True):
        self.connection = LakeConnection(config, create)
        self.writing = LakeWriting(self.connection)
        self.reading = LakeReading(self.connection)
        self.maintenance = LakeMaintenance(self.connection)

    # ------------------------------------------------------------------ the connection's

    @property
    def config(self) -> LakeConfig:
        return self.connection.config

    @property
    def create(self) -> bool:
        return self.connection.create

    @property
    def data_path(self) -> str | None:
        """The lake's own data path once attached (the config's until then)."""
        return self.connection.data_path

    def open(self) -> Self:
        """Attach the lake (creating its tables when `create` and it has none); LakeUnavailable/LakeError else."""
        self.connection.open()
        return self

    def reset(self) -> None:
        self.connection.reset()

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        return self.connection.cursor()

    # ------------------------------------------------------------------ writing's, maintenance's

    def commit(self, table: pa.Table | None, problems: list[Problem] | tuple = ()) -> LakeCommit:
        return self.writing.commit(table, problems)

    def maintain(self, expire_older_than_s: float, cleanup_older_than_s: float) -> dict[str, int]:
        return self.maintenance.maintain(expire_older_than_s, cleanup_older_than_s)

    # ------------------------------------------------------------------ reading's

    def snapshot(self) -> Snapshot:
        return self.reading.snapshot()

    def rollouts_between(self, after: int, upto: int, change_feed: bool = False) -> pa.Table:
        return self.reading.rollouts_between(after, upto, change_feed)

    def rollouts_added(self, after: int, upto: int, change_feed: bool = False) -> AddedRows:
        return self.reading.rollouts_added(after, upto, change_feed)

    def files_added(self, after: int, upto: int) -> list[DataFile] | None:
        return self.reading.files_added(after, upto)

    def problems_between(self, after: int, upto: int) -> pa.Table:
        return self.reading.problems_between(after, upto)

    def tables_inserted_into(self, after: int, upto: int) -> set[str] | None:
        return self.reading.tables_inserted_into(after, upto)

    def iter_rollouts(self, after: int, upto: int, max_rows: int = 32768) -> Iterator[tuple[int, pa.Table]]:
        return self.reading.iter_rollouts(after, upto, max_rows)

    def group_ids(self, model_id: str, model_revision: str | None = None, policy_step: int | None = None) -> set[str]:
        return self.reading.group_ids(model_id, model_revision, policy_step)

    def group_prompts(self, model_id: str, model_revision: str, policy_step: int) -> dict[str, str]:
        return self.reading.group_prompts(model_id, model_revision, policy_step)

    def counts(self) -> dict[str, int]:
        return self.reading.counts()
