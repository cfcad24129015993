"""Lookup files: what point reads of whole groups are served from, beside each shard. Split by job, as DuckDB's storage
splits its readers from its writers: `layout.py` (the file's tables and trailer, the IPC stream, which the others
share), `writer.py`, `rebuild.py` (from the shard), `reader.py` (`ShardReader`, the store's reads of whole groups).
The rest of the local store imports them from here.

A lookup answers whole groups as Arrow IPC record batch messages, one per group, behind a schema message: no
Parquet decoding of neighbours, no per-row Python. Every shard has a lookup file,
`<root>/lookup/model=<model_id>/<shard name>.lookup`, holding for each group either

- its **template** (a shard laid out by `shards.encode_shard`, where each group's bulk values are whole Parquet
  data pages of their own, see `pages.py`): the group's IPC message without the values of the bulk columns
  (completion text bytes, token ids, logprobs: ~97% of a row), plus where those pages lie in the shard. A
  lookup preads the template and the pages, checks the pages' own Parquet CRC-32, decompresses them and splices
  their values into the template's three holes. The bulk data is kept once, in the shard; a template costs
  ~0.5 KB per rollout (the message header and the small columns). Or
- a **copy** of its whole IPC message (a shard laid out otherwise: a foreign writer's, one written before this
  format), sent as it is.

Then a block table (per group: row start, rows, record offset, length and CRC-32; for a template its first
page, pages per bulk column and the three holes) and a page table (per page: body offset and length in the
shard, levels length, decompressed size, codec, Parquet's CRC-32, bytes to skip before the values), and a
trailer. `Block` and `PageEntry` (`layout.py`) are the one definition of the two tables' columns: the writer writes them,
the reader names its columns by them (`BLOCK`, `PAGE`). Lookup files are derived: the writer writes one before
publishing the shard (it has the table and the encoded file in memory), the store rebuilds a missing or damaged
one from the shard (from its small columns and page headers when every group has pages of its own; whole
otherwise), and they may be deleted at any time.
The trailer records the CRC-32 and size of the shard's Parquet footer: a lookup file is written only from rows
that passed `validate_table`, so a matching footer tells the store that this very shard was checked whole by
its writer (`ingest.py` then decodes only its small columns); any rewrite of the shard changes its footer.
Their directory is not fsynced after the rename: a file lost or torn by a crash fails its size or CRC checks
and is rebuilt; a shard damaged under it fails its pages' CRC checks (and is quarantined, `queries.py`).
"""

from graft.services.store_api.local.lookup.layout import (
    BLOCK,
    BLOCK_PAGE_COUNTS,
    LOOKUP_DIR,
    LOOKUP_SUFFIX,
    PAGE,
    SCHEMA_MESSAGE,
    Block,
    LookupFileInvalid,
    PageEntry,
    ShardReadError,
    arrow_stream,
    lookup_footer,
    lookup_path,
    read_stream,
    shard_footer,
)
from graft.services.store_api.local.lookup.reader import LookupFile, ShardReader
from graft.services.store_api.local.lookup.rebuild import (
    CHUNK_ROWS,
    read_whole_groups,
    rebuild_lookup_file,
    shard_pages,
)
from graft.services.store_api.local.lookup.writer import table_groups, template_table, write_lookup_file

__all__ = [
    "BLOCK",
    "BLOCK_PAGE_COUNTS",
    "CHUNK_ROWS",
    "LOOKUP_DIR",
    "LOOKUP_SUFFIX",
    "PAGE",
    "SCHEMA_MESSAGE",
    "Block",
    "LookupFile",
    "LookupFileInvalid",
    "PageEntry",
    "ShardReadError",
    "ShardReader",
    "arrow_stream",
    "lookup_footer",
    "lookup_path",
    "read_stream",
    "read_whole_groups",
    "rebuild_lookup_file",
    "shard_footer",
    "shard_pages",
    "table_groups",
    "template_table",
    "write_lookup_file",
]
