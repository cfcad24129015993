"""The store's one config object: environment variables GRAFT_STORE_<FIELD>, YAML, or the command line."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class StoreSettings(BaseSettings):
    """Settings of the trajectory store server (`graft-store serve`)."""

    model_config = SettingsConfigDict(env_prefix="GRAFT_STORE_", extra="forbid")

    root: Path = Field(default=Path("stores/local"), description="store root: rollouts/, prompts/, quarantine/, index.duckdb")
    host: str = Field(default="127.0.0.1", description="interface to bind; loopback unless told otherwise")
    port: int = Field(default=8600, ge=1, le=65535, description="TCP port")
    token: str | None = Field(default=None, description="bearer token required for writes (POST /v1/groups); none: open")
    ingest_interval_s: float = Field(default=0.2, gt=0, le=10, description="how often the ingest loop looks for new shards")
    compact_interval_s: float = Field(default=60.0, ge=0, description="how often to compact small shards; 0: never automatically")
    compact_small_rows: int = Field(default=4096, ge=1, description="a shard with fewer live rows than this is small")
    compact_target_rows: int = Field(default=32768, ge=64, description="rows per compacted file (bounds compaction memory)")
    compact_min_files: int = Field(default=4, ge=2, description="compact a model once it has this many small shards")
    retired_grace_s: float = Field(default=30.0, ge=0, description="keep compacted-away shards this long for in-flight reads")
    tmp_max_age_s: float = Field(default=3600.0, gt=0, description="delete writers' leftover .tmp- files older than this")
    max_open_files: int = Field(default=256, ge=1, description="shards' lookup files kept open for lookups")
    max_body_mb: float = Field(default=256.0, gt=0, description="largest request body for POST /v1/groups, MB")
    max_request_kb: float = Field(default=1024.0, gt=0, description="largest request body for any other request, KB")
    max_scan_groups: int = Field(default=4096, ge=1, description="groups GET /v1/rollouts reads at most per page")
    duckdb_memory_limit: str = Field(default="256MB", description="DuckDB memory limit of the index")
    tokenizers: list[Path] = Field(default_factory=list, description="model paths (HF or tokenizer directories, GGUF) "
                                   "whose tokenizers the browser decodes token ids with, matched by fingerprint to "
                                   "each row's tokenizer_id")
    log_level: str = Field(default="info", description="debug, info, warning or error")
