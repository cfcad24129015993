"""The store's DuckLake: rollouts and problems as DuckLake tables, DuckDB's extensions from PyPI wheels.

A lake is a SQL catalog (PostgreSQL for many hosts, SQLite for one) plus Parquet data files (S3-compatible
object storage or a shared path). `rollouts` and `problems` have the columns of ROLLOUT_ARROW_SCHEMA and
PROBLEM_ARROW_SCHEMA; `rollouts` is partitioned by model_id, like the local store's directories. Plain DuckDB
reads it with `ATTACH 'ducklake:<catalog>' AS lake` (docs/lake.md).

`Lake` is one handle on a lake made of parts that each own one job, all on the attach of `attach.py`:

- `config.py`: where the lake is (`LakeConfig`), its errors, DuckDB's lake extensions;
- `attach.py`: attaching (and making the tables), the connection discipline, the data files' storage;
- `commit.py`: committing whole groups and their problems in one transaction;
- `windows.py`: reading what snapshot windows added, in commit order (what replicas follow);
- `maintenance.py`: DuckLake's merges, snapshot expiry and file cleanup.

`replica.py` serves a lake through the local index over a cache; `migrate.py` copies a store between a local
root and a lake.
"""

from __future__ import annotations

from services.store_api.lake.commit import LakeWriting
from services.store_api.lake.maintenance import LakeMaintenance
from services.store_api.lake.windows import LakeReading


class Lake(LakeWriting, LakeReading, LakeMaintenance):
    """One process's handle on a lake: attach, commit groups, follow snapshots, maintain. Thread-safe."""
