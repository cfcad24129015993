"""The store on a DuckLake (a SQL catalog plus Parquet data files): the lake, a replica that serves it, migration.

What other parts use of the lake itself, imported from here (`from graft.services.store_api.lake import Lake`). The
replica (`replica.LakeReplica`) and migration (`migrate.py`) sit on both the lake and the local index: they are
imported from their modules, so that importing the lake's errors does not load them.
"""

from graft.services.store_api.lake.config import ExtensionMissing, LakeConfig, LakeError, LakeUnavailable
from graft.services.store_api.lake.lake import Lake
from graft.services.store_api.lake.reading import AddedRows, DataFile, Snapshot
from graft.services.store_api.lake.writing import LakeCommit

__all__ = [
    "AddedRows",
    "DataFile",
    "ExtensionMissing",
    "Lake",
    "LakeCommit",
    "LakeConfig",
    "LakeError",
    "LakeUnavailable",
    "Snapshot",
]
