"""The store's DuckLake: rollouts and problems as DuckLake tables, DuckDB's extensions from PyPI wheels.

A lake is a SQL catalog (PostgreSQL for many hosts, SQLite for one) plus Parquet data files (S3-compatible
object storage or a shared path). `rollouts` and `problems` have the columns of ROLLOUT_ARROW_SCHEMA and
PROBLEM_ARROW_SCHEMA; `rollouts` is partitioned by model_id, like the local store's directories. Plain DuckDB
reads it with `ATTACH 'ducklake:<catalog>' AS lake` (docs/lake.md).

`Lake` is one handle on a lake: it opens and closes it and hands out its parts, each an object that owns its state
and works through the connection's public methods (none inherits from another). Callers call the part that does the
work; no method of `Lake` only passes its arguments on (tests/layout/test_store.py checks):

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

from typing import Self

from graft.services.store_api.lake.config import LakeConfig
from graft.services.store_api.lake.connection import LakeConnection
from graft.services.store_api.lake.maintenance import LakeMaintenance
from graft.services.store_api.lake.reading import LakeReading
from graft.services.store_api.lake.writing import LakeWriting


class Lake:
    """One process's handle on a lake: open and close it, and call its parts (`lake.writing.commit(...)`,
    `lake.reading.snapshot()`, `lake.maintenance.maintain(...)`, `lake.connection.cursor()`). Thread-safe."""

    def __init__(self, config: LakeConfig, create: bool = True):
        self.config = config
        self.connection = LakeConnection(config, create)
        self.writing = LakeWriting(self.connection)
        self.reading = LakeReading(self.connection)
        self.maintenance = LakeMaintenance(self.connection)

    def open(self) -> Self:
        """Attach the lake (creating its tables when `create` and it has none); LakeUnavailable/LakeError else."""
        self.connection.open()
        return self

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
