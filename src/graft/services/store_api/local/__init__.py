"""The local store: Parquet shards under a root, their lookup files, and the DuckDB index over them (`StoreIndex`).

What the other parts (the HTTP face, the browser, the lake, generators, benchmarks) use of it, imported from here
(`from graft.services.store_api.local import StoreIndex`); its modules are its own (tests/layout/test_store.py checks it).
"""

from graft.services.store_api.local.catalog import IndexLocked
from graft.services.store_api.local.durable import fsync_directory, publish, write_temporary
from graft.services.store_api.local.index import StoreIndex
from graft.services.store_api.local.ingest import summarise_groups
from graft.services.store_api.local.lookup import arrow_stream, read_stream
from graft.services.store_api.local.manifest import live_files
from graft.services.store_api.local.mirror import GroupConflict, GroupRef, now_us
from graft.services.store_api.local.queries import BadCursor, decode_cursor, encode_cursor, us_to_datetime
from graft.services.store_api.local.shards import (
    encode_shard,
    model_dir,
    row_group_plan,
    write_groups,
    write_problems,
    write_rollout_table,
)

__all__ = [
    "BadCursor",
    "GroupConflict",
    "GroupRef",
    "IndexLocked",
    "StoreIndex",
    "arrow_stream",
    "decode_cursor",
    "encode_cursor",
    "encode_shard",
    "fsync_directory",
    "live_files",
    "model_dir",
    "now_us",
    "publish",
    "read_stream",
    "row_group_plan",
    "summarise_groups",
    "us_to_datetime",
    "write_groups",
    "write_problems",
    "write_rollout_table",
    "write_temporary",
]
