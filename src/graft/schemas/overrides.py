"""The command-line style of `graft-train`, `graft-generate` and `graft-eval`, implemented once: a config file given as
`--config PATH`, a few named flags, `--set key=value` over the validated pydantic config (`load_config`), and
`show-config` listing every field with its default and its doc line. typer is imported only by the commands' helpers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


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
        # a section of several kinds (peers: one per source; sampler: one per backend), each maybe tagged: its fields
        members = [get_args(a)[0] if get_origin(a) is Annotated else a for a in get_args(annotation)]
        variants = [a for a in members if isinstance(a, type) and issubclass(a, BaseModel)]
        tag = info.discriminator if isinstance(info.discriminator, str) else getattr(variants[0], "KIND", None) \
            if variants else None
        if variants and tag:
            default = info.get_default(call_default_factory=True)
            rows.append((f"{prefix}{name}.{tag}", repr(getattr(default, tag, None)), info.description or ""))
            rows.extend(row for variant in variants for row in describe_fields(variant, f"{prefix}{name}.")
                        if row[0] != f"{prefix}{name}.{tag}")
            continue
        value = None if info.is_required() else info.get_default(call_default_factory=True)
        default = "(required)" if info.is_required() else repr(str(value) if isinstance(value, Path) else value)
        rows.append((f"{prefix}{name}", default, info.description or ""))
    return rows


def format_fields(model: type[BaseModel]) -> str:
    """`show-config`'s table: one line per field."""
    return "\n".join(f"{name:38s} {default:>22s}  {doc}" for name, default, doc in describe_fields(model))


def load_config(cls: type[M], path: str | Path | None = None, overrides: Sequence[str] = (),
                values: dict[str, Any] | None = None) -> M:
    """`cls` validated from a YAML file (optional), then `values` (named flags by dotted field name, those not None), then
    `overrides` (`key.sub=value` pairs, YAML-parsed): later wins. The one reader of graft-train's, graft-generate's and
    graft-eval's configs; raises FileNotFoundError, ValueError (a file that is no mapping, a pair that is no key=value)
    or pydantic's ValidationError."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist; pass the path of a YAML file (configs/ holds "
                                    "examples)")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of field: value, not {type(loaded).__name__}")
        data = loaded or {}
    for key, value in (values or {}).items():
        if value is not None:
            *parents, leaf = key.split(".")
            node = data
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
    return cls.model_validate(apply_overrides(data, list(overrides)))


def command_line_config(cls: type[M], path: Path | None, sets: Sequence[str] = (),
                        values: dict[str, Any] | None = None) -> M:
    """`load_config` for a command line: a config that does not load exits 2 with the reason, one line per field."""
    import typer
    from pydantic import ValidationError

    try:
        return load_config(cls, path, sets, values)
    except ValidationError as error:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or cls.__name__}: {e['msg']}" for e in error.errors()]
        typer.echo(f"error: the configuration ({path or 'command line'}) is invalid:\n" + "\n".join(lines), err=True)
    except (ValueError, FileNotFoundError) as error:
        typer.echo(f"error: {error}", err=True)
    raise typer.Exit(2)


def add_show_config(app: Any, cls: type[BaseModel], summary: Callable[[Any], str] | None = None) -> None:
    """`<command> show-config [--config F] [--set k=v]` on a typer app: every field of `cls` with its default and doc
    line, and the resolved YAML when given a config or --set, followed by `summary` of it (a YAML comment)."""
    import typer

    @app.command("show-config")
    def show_config(
        config: Optional[Path] = typer.Option(None, "--config", "-c", help=f"YAML file with {cls.__name__} fields"),
        sets: list[str] = typer.Option([], "--set", help="field=value (repeatable)"),
    ) -> None:
        """Every field with its default and its one-line doc; with a config or --set, the resolved YAML too."""
        typer.echo(format_fields(cls))
        if config is not None or sets:
            cfg = command_line_config(cls, config, sets)
            typer.echo("\n# resolved\n" + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            if summary is not None:
                typer.echo(f"# {summary(cfg)}")
