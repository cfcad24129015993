"""The store's one config object: environment variables GRAFT_STORE_<FIELD>, YAML, or the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# a writer uploads its data files, then commits; a commit that loses to others' retries for a minute or more
# (lake/writing.py, COMMIT_ATTEMPTS): an orphan younger than this may be one still being committed, not one left by a crash
MIN_LAKE_FILE_GRACE_S = 600.0


class StoreSettings(BaseSettings):
    """Settings of the trajectory store server (`graft-store serve`)."""

    model_config = SettingsConfigDict(env_prefix="GRAFT_STORE_", extra="forbid")

    root: Path = Field(default=Path("stores/local"), description="store root: rollouts/, prompts/, quarantine/, index.duckdb "
                                                                "(backend lake: the replica's lookup cache)")
    backend: Literal["local", "lake"] = Field(default="local", description="local: shards under root, indexed by this "
                                              "process; lake: a replica of a DuckLake (lake_catalog), cached under root")
    lake_catalog: str | None = Field(default=None, description="backend lake: 'ducklake:postgres:<libpq string>' or "
                                     "'ducklake:sqlite:<path>'; S3 endpoint and keys from AWS_* or GRAFT_LAKE_S3_*")
    lake_data_path: str | None = Field(default=None, description="backend lake: where a new lake puts its data files "
                                       "(s3://bucket/prefix/ or a shared directory); an existing lake knows its own")
    lake_retry_unreadable_s: float = Field(default=60.0, gt=0, description="backend lake: how often a replica reads "
                                           "again a snapshot whose data files it could not read (corrupt, missing)")
    lake_snapshot_retention_s: float = Field(default=86400.0, gt=0, description="graft-store compact on a lake: expire "
                                             "snapshots older than this (time travel and slow followers need them)")
    lake_file_grace_s: float = Field(default=3600.0, ge=MIN_LAKE_FILE_GRACE_S, description="graft-store compact on a "
                                     "lake: delete merged-away and orphaned data files older than this (in-flight "
                                     "reads may still use them; a writer's file is an orphan until its commit lands)")
    host: str = Field(default="127.0.0.1", description="interface to bind; loopback unless told otherwise")
    port: int = Field(default=8600, ge=1, le=65535, description="TCP port")
    # min_length: an empty GRAFT_STORE_TOKEN (compose's `${GRAFT_STORE_TOKEN:-}`) would require an empty token that
    # no client sends, locking every writer out: refused at start, naming the variable, instead
    token: str | None = Field(default=None, min_length=1, description="bearer token required for writes (POST "
                              "/v1/groups); none: open. Leave GRAFT_STORE_TOKEN unset for an open store, never empty")
    ingest_interval_s: float = Field(default=0.2, gt=0, le=10, description="how often the ingest loop looks for new shards")
    compact_interval_s: float = Field(default=60.0, ge=0, description="how often to compact small shards; 0: never automatically")
    compact_small_rows: int = Field(default=4096, ge=1, description="a shard with fewer live rows than this is small")
    compact_target_rows: int = Field(default=32768, ge=64, description="rows per compacted file (bounds compaction memory)")
    compact_min_files: int = Field(default=4, ge=2, description="compact a model once it has this many small shards")
    retired_grace_s: float = Field(default=30.0, ge=0, description="keep compacted-away shards this long for in-flight reads")
    tmp_max_age_s: float = Field(default=3600.0, gt=0, description="delete writers' leftover .tmp- files older than this")
    max_open_files: int = Field(default=2048, ge=1, description="shards' lookup files kept open for lookups (2 "
                                "descriptors each: the store raises its soft descriptor limit to fit them)")
    max_body_mb: float = Field(default=256.0, gt=0, description="largest request body for POST /v1/groups, MB")
    max_request_kb: float = Field(default=1024.0, gt=0, description="largest request body for any other request, KB")
    max_scan_groups: int = Field(default=4096, ge=1, description="groups GET /v1/rollouts reads at most per page")
    duckdb_memory_limit: str = Field(default="256MB", description="DuckDB memory limit of the index (and of a "
                                     "lake replica's connection to the lake)")
    tokenizers: list[Path] = Field(default_factory=list, description="model paths (HF or tokenizer directories, GGUF) "
                                   "whose tokenizers the browser decodes token ids with, matched by fingerprint to "
                                   "each row's tokenizer_id")
    max_wanted: int = Field(default=100_000, ge=1, description="wanted prompts kept open, (prompt, learner) pairs; past "
                            "it the least recently missed is dropped (counted as evicted)")
    wanted_within_steps: int = Field(default=10, ge=1, description="N of the broker's metric: the share of wants "
                                     "cleared within N of the learner's steps")
    log_level: str = Field(default="info", description="debug, info, warning or error")

    @model_validator(mode="after")
    def _backend_settings(self) -> StoreSettings:
        if self.backend == "lake" and not self.lake_catalog:
            raise ValueError("backend 'lake' needs lake_catalog (GRAFT_STORE_LAKE_CATALOG or --lake-catalog), e.g. "
                             "'ducklake:postgres:dbname=graft host=... user=...'")
        if self.backend == "local" and (self.lake_catalog or self.lake_data_path):
            raise ValueError("lake_catalog / lake_data_path are set but backend is 'local', which would ignore them: "
                             "set backend 'lake' (GRAFT_STORE_BACKEND=lake or --backend lake), or unset them")
        return self
