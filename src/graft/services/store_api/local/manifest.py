"""`<root>/manifest.json`: the live set of files, for readers outside the store (DuckDB, polars, pandas).

A glob over `rollouts/` is not the store's content: a shard the store has not indexed yet, one it will
quarantine, or one compaction replaced (kept `retired_grace_s` for in-flight reads) would be counted too.
The store rewrites this file (temporary file, fsync, rename) whenever the live set changes, after the index
committed the change and before any file it no longer lists is moved or deleted, so a reader that lists its
files from it counts exactly what the API counts. It lists paths relative to the root:

    {"format": "graft-store-manifest", "version": 1, "written_at": "...", "groups": 1234,
     "rollouts": ["rollouts/model=a/part-....parquet", ...], "prompts": ["prompts/dataset=d/part-....parquet", ...]}

A file it lists stays readable for at least `retired_grace_s` (30 s by default) after it stops listing it.
"""

from __future__ import annotations

import functools
from datetime import datetime, timezone
from pathlib import Path

import orjson

from graft.services.store_api.local.durable import publish, write_temporary

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "graft-store-manifest"
MANIFEST_VERSION = 1


def write_manifest(root: Path, rollouts: list[str], prompts: list[str], groups: int) -> Path:
    """Atomically replace <root>/manifest.json with this live set (paths relative to `root`)."""
    body = orjson.dumps({
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
        "written_at": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "groups": groups, "rollouts": rollouts, "prompts": prompts,
    }, option=orjson.OPT_INDENT_2)
    return publish(write_temporary(Path(root) / MANIFEST_NAME, functools.partial(_write_bytes, body), root=Path(root)))


def _write_bytes(body: bytes, path: str) -> None:
    with open(path, "wb") as f:
        f.write(body)


def live_files(root: str | Path, kind: str = "rollouts") -> list[str]:
    """The live files of a store (`kind` 'rollouts' or 'prompts') as paths under `root`, from its manifest.

    The one way to read exactly what the store serves without asking it, e.g.
    `duckdb.read_parquet(live_files(root))` or `polars.read_parquet(live_files(root))`.
    """
    manifest = orjson.loads((Path(root) / MANIFEST_NAME).read_bytes())
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{Path(root) / MANIFEST_NAME} is not a version-{MANIFEST_VERSION} {MANIFEST_FORMAT}")
    return [str(Path(root) / rel) for rel in manifest[kind]]
