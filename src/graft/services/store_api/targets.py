"""What a store target string names (graft-generate --store, graft-store migrate): a lake or not. Its own module,
importing nothing, so that a process that only writes shards or pushes (the vLLM generator in .venv-vllm) tells
the kinds apart without loading DuckDB."""

from __future__ import annotations

LAKE_PREFIX = "ducklake:"


def is_lake_target(target: str | None) -> bool:
    """Whether a store target names a lake."""
    return bool(target) and str(target).startswith(LAKE_PREFIX)
