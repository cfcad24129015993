"""The command-line style of `graft-train`, `graft-generate` and `graft-eval`: a few named flags, `--set key=value`
over the validated pydantic config, and `show-config` listing every field with its default and its doc line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted `key.sub=value` pairs in a nested dict; values are parsed as YAML (so 0, true, null, [a, b] work)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. graft.peer_negative_scale=0)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return data


def describe_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) of every field, nested sections flattened, for `show-config`."""
    rows: list[tuple[str, str, str]] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(describe_fields(annotation, f"{prefix}{name}."))
            continue
        value = None if info.is_required() else info.get_default(call_default_factory=True)
        default = "(required)" if info.is_required() else repr(str(value) if isinstance(value, Path) else value)
        rows.append((f"{prefix}{name}", default, info.description or ""))
    return rows


def format_fields(model: type[BaseModel]) -> str:
    """`show-config`'s table: one line per field."""
    return "\n".join(f"{name:38s} {default:>22s}  {doc}" for name, default, doc in describe_fields(model))
