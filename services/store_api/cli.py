"""`graft-store serve | rebuild | compact | stats`: run the store, or work on its index offline."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import httpx
import typer
import yaml

from services.store_api.settings import StoreSettings

app = typer.Typer(help="The graft trajectory store: Parquet shards, a DuckDB index and an HTTP API.",
                  no_args_is_help=True, add_completion=False)

RootOption = Annotated[Optional[Path], typer.Option("--root", help="store root (default: GRAFT_STORE_ROOT or stores/local)")]
HostOption = Annotated[Optional[str], typer.Option("--host", help="interface (default: GRAFT_STORE_HOST or 127.0.0.1)")]
PortOption = Annotated[Optional[int], typer.Option("--port", help="TCP port (default: GRAFT_STORE_PORT or 8600)")]
ConfigOption = Annotated[Optional[Path], typer.Option("--config", help="YAML file of StoreSettings fields")]


def load_settings(config: Path | None = None, **overrides) -> StoreSettings:
    """Settings from GRAFT_STORE_* variables, then the YAML file, then the command line (last wins)."""
    values: dict = {}
    if config is not None:
        loaded = yaml.safe_load(config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise typer.BadParameter(f"{config} must hold a mapping of StoreSettings fields")
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return StoreSettings(**values)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@app.command()
def serve(
    root: RootOption = None, host: HostOption = None, port: PortOption = None, config: ConfigOption = None,
    rebuild: Annotated[bool, typer.Option(help="rebuild the index from the Parquet files before serving")] = False,
    tokenizer: Annotated[Optional[list[Path]], typer.Option(
        help="a model path as the generator took it: the browser shows its tokens' text (repeat per model)")] = None,
) -> None:
    """Serve the API and the trajectory browser (http://HOST:PORT/ui/); the store process is the only owner of
    <root>/index.duckdb."""
    import uvicorn

    from services.store_api.app import create_app
    from services.store_api.catalog import IndexLocked
    from services.store_api.index import StoreIndex

    settings = load_settings(config, root=root, host=host, port=port, tokenizers=tokenizer or None)
    configure_logging(settings.log_level)
    if rebuild:
        index = StoreIndex(settings)
        try:
            index.rebuild()
        except IndexLocked as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        index.close()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False)


@app.command()
def rebuild(root: RootOption = None, config: ConfigOption = None) -> None:
    """Rebuild the index from the Parquet files alone (stop the server first)."""
    from services.store_api.catalog import IndexLocked
    from services.store_api.index import StoreIndex

    settings = load_settings(config, root=root)
    configure_logging(settings.log_level)
    index = StoreIndex(settings)
    try:
        groups = index.rebuild()
    except IndexLocked as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    stats = index.stats()
    index.close()
    typer.echo(json.dumps({"groups": groups, "rollouts": stats.total_rollouts, "files": stats.files}))


@app.command()
def compact(
    root: RootOption = None, config: ConfigOption = None,
    model: Annotated[Optional[str], typer.Option(help="only this model")] = None,
    min_files: Annotated[int, typer.Option(help="compact a model once it has this many small shards")] = 2,
) -> None:
    """Merge small shards into large files sorted by prompt id (stop the server first; it compacts by itself)."""
    from services.store_api.catalog import IndexLocked
    from services.store_api.index import StoreIndex

    settings = load_settings(config, root=root)
    configure_logging(settings.log_level)
    try:
        index = StoreIndex(settings).open()
    except IndexLocked as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    report = index.compact(model_id=model, min_files=min_files)
    report["files_deleted"] = index.delete_retired(grace_s=0)  # offline: no reader can hold the old files
    index.close()
    typer.echo(json.dumps(report))


@app.command()
def stats(root: RootOption = None, host: HostOption = None, port: PortOption = None, config: ConfigOption = None) -> None:
    """Print the store's stats as JSON: from the running server if one answers, else from the index offline."""
    settings = load_settings(config, root=root, host=host, port=port)
    try:
        response = httpx.get(f"http://{settings.host}:{settings.port}/v1/stats", timeout=5.0)
        response.raise_for_status()
        typer.echo(response.text)
        return
    except httpx.HTTPError:
        pass
    from services.store_api.catalog import IndexLocked
    from services.store_api.index import StoreIndex

    configure_logging(settings.log_level)
    try:
        index = StoreIndex(settings).open()
    except IndexLocked as exc:
        typer.echo(f"error: no server answered on {settings.host}:{settings.port} and {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(index.stats().model_dump_json())
    index.close()


@app.command()
def migrate(
    source: Annotated[str, typer.Option("--from", help="a store root, or a lake: 'ducklake:postgres:...' / 'ducklake:sqlite:...'")],
    target: Annotated[str, typer.Option("--to", help="a store root, or a lake (the other kind than --from)")],
    lake_data_path: Annotated[Optional[str], typer.Option(
        help="data path of a new lake (s3://bucket/prefix/ or a directory; default GRAFT_LAKE_DATA_PATH)")] = None,
    progress: Annotated[bool, typer.Option(help="show progress bars")] = True,
) -> None:
    """Copy a store between a local root and a lake, either way (S3 settings from AWS_* / GRAFT_LAKE_*).

    Idempotent: groups and problems the target holds are skipped, so an interrupted migration is run again.
    Stop a local store's server first, or migrate what its shards hold at the moment they are read.
    """
    from services.store_api.lake import Lake, LakeConfig, LakeError, is_lake_target
    from services.store_api.migrate import lake_to_local, local_to_lake

    configure_logging("info")
    if is_lake_target(source) == is_lake_target(target):
        typer.echo("error: migrate copies between a store root and a lake ('ducklake:...'): give one of each", err=True)
        raise typer.Exit(2)
    lake_spec, root = (target, Path(source)) if is_lake_target(target) else (source, Path(target))
    if is_lake_target(target) and not (root / "rollouts").is_dir():
        typer.echo(f"error: {root} is not a store root (no rollouts/ directory)", err=True)
        raise typer.Exit(2)
    overrides = {"data_path": lake_data_path} if lake_data_path else {}
    try:
        with Lake(LakeConfig(catalog=lake_spec, **overrides), create=is_lake_target(target)) as lake:
            report = local_to_lake(root, lake, progress) if is_lake_target(target) else lake_to_local(lake, root, progress)
    except (LakeError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps(report))


if __name__ == "__main__":
    app()
