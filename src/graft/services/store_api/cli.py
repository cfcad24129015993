"""`graft-store serve | rebuild | compact | stats | migrate`: run the store, or work on it offline.

Every command but migrate works on either backend: `local` (shards under --root) or `lake` (--lake-catalog;
--root is then the replica's lookup cache).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import httpx
import typer
import yaml

from graft.services.store_api.settings import StoreSettings

app = typer.Typer(help="The graft trajectory store: Parquet shards, a DuckDB index and an HTTP API.",
                  no_args_is_help=True, add_completion=False)

RootOption = Annotated[Optional[Path], typer.Option("--root", help="store root (default: GRAFT_STORE_ROOT or stores/local)")]
HostOption = Annotated[Optional[str], typer.Option("--host", help="interface (default: GRAFT_STORE_HOST or 127.0.0.1)")]
PortOption = Annotated[Optional[int], typer.Option("--port", help="TCP port (default: GRAFT_STORE_PORT or 8600)")]
ConfigOption = Annotated[Optional[Path], typer.Option("--config", help="YAML file of StoreSettings fields")]
BackendOption = Annotated[Optional[str], typer.Option(
    "--backend", help="local or lake (default: GRAFT_STORE_BACKEND or local)")]
LakeCatalogOption = Annotated[Optional[str], typer.Option(
    "--lake-catalog", help="backend lake: 'ducklake:postgres:<libpq string>' or 'ducklake:sqlite:<path>'")]
LakeDataPathOption = Annotated[Optional[str], typer.Option(
    "--lake-data-path", help="backend lake: data path of a new lake (s3://bucket/prefix/ or a shared directory)")]


def load_settings(config: Path | None = None, **overrides) -> StoreSettings:
    """Settings from GRAFT_STORE_* variables, then the YAML file, then the command line (last wins)."""
    values: dict = {}
    if config is not None:
        loaded = yaml.safe_load(config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise typer.BadParameter(f"{config} must hold a mapping of StoreSettings fields")
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return StoreSettings(**values)
    except ValueError as exc:  # pydantic's ValidationError: say which setting is wrong, without a traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def open_store(settings: StoreSettings, what: str = ""):
    """The settings' store (graft.services.store_api.backend.store_backend), opened; a clear error and exit 1 if it cannot."""
    from graft.services.store_api.backend import store_backend
    from graft.services.store_api.lake.config import LakeError
    from graft.services.store_api.local import IndexLocked

    try:
        return store_backend(settings).open()
    except (IndexLocked, LakeError) as exc:
        typer.echo(f"error: {what}{exc}", err=True)
        raise typer.Exit(1) from exc


def holds_store(root: Path) -> bool:
    """Whether `root` holds a store (or a lake replica's cache). Opening a root creates its folders and index: a read
    or offline maintenance checks this first, so a mistyped or default root is said, not made."""
    return (root / "index.duckdb").is_file() or (root / "rollouts").is_dir()


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@app.command()
def serve(
    root: RootOption = None, host: HostOption = None, port: PortOption = None, config: ConfigOption = None,
    backend: BackendOption = None, lake_catalog: LakeCatalogOption = None, lake_data_path: LakeDataPathOption = None,
    rebuild: Annotated[bool, typer.Option(help="rebuild the index from the Parquet files (backend lake: the cache from "
                                                "the lake) before serving")] = False,
    tokenizer: Annotated[Optional[list[Path]], typer.Option(
        help="a model path as the generator took it: the browser shows its tokens' text (repeat per model)")] = None,
) -> None:
    """Serve the API and the trajectory browser (http://HOST:PORT/ui/); the store process is the only owner of
    <root>/index.duckdb (backend lake: a replica of a lake, its cache under --root)."""
    import uvicorn

    from graft.services.store_api.http.app import create_app

    settings = load_settings(config, root=root, host=host, port=port, tokenizers=tokenizer or None, backend=backend,
                             lake_catalog=lake_catalog, lake_data_path=lake_data_path)
    configure_logging(settings.log_level)
    if rebuild:
        _rebuild(settings)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False)


def _rebuild(settings: StoreSettings) -> dict:
    from graft.services.store_api.backend import store_backend
    from graft.services.store_api.lake.config import LakeError
    from graft.services.store_api.local import IndexLocked

    store = store_backend(settings)
    try:
        groups = store.rebuild()
    except (IndexLocked, LakeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    stats = store.stats()
    store.close()
    return {"groups": groups, "rollouts": stats.total_rollouts, "files": stats.files}


@app.command()
def rebuild(root: RootOption = None, config: ConfigOption = None, backend: BackendOption = None,
            lake_catalog: LakeCatalogOption = None) -> None:
    """Rebuild the index from the Parquet files alone, or a replica's cache from the lake (stop the server first)."""
    settings = load_settings(config, root=root, backend=backend, lake_catalog=lake_catalog)
    configure_logging(settings.log_level)
    typer.echo(json.dumps(_rebuild(settings)))


@app.command()
def compact(
    root: RootOption = None, config: ConfigOption = None, backend: BackendOption = None,
    lake_catalog: LakeCatalogOption = None,
    model: Annotated[Optional[str], typer.Option(help="only this model (backend local)")] = None,
    min_files: Annotated[int, typer.Option(help="compact a model once it has this many small shards (backend local)")] = 2,
) -> None:
    """Merge small files: a local store's shards, or a lake's data files.

    Backend local: shards into large files sorted by prompt id (stop the server first; it compacts by itself).
    Backend lake: DuckLake's merge of adjacent files, then snapshot expiry and file cleanup
    (lake_snapshot_retention_s, lake_file_grace_s); replicas and writers keep running.
    """
    settings = load_settings(config, root=root, backend=backend, lake_catalog=lake_catalog)
    configure_logging(settings.log_level)
    if settings.backend == "lake":
        from graft.services.store_api.lake.config import LakeConfig, LakeError
        from graft.services.store_api.lake.lake import Lake

        if model is not None:
            typer.echo("error: --model applies to the local backend; DuckLake merges every table's files", err=True)
            raise typer.Exit(2)
        try:
            with Lake(LakeConfig.of_replica(settings), create=False) as lake:
                report = lake.maintenance.maintain(settings.lake_snapshot_retention_s, settings.lake_file_grace_s)
        except LakeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        typer.echo(json.dumps(report))
        return
    if not holds_store(settings.root):
        typer.echo(f"error: {settings.root} holds no store (no index.duckdb or rollouts/): nothing to compact; "
                   "give --root of a store", err=True)
        raise typer.Exit(1)
    store = open_store(settings)
    report = store.index.compaction.compact(model_id=model, min_files=min_files)
    # offline: no reader can hold the old files
    report["files_deleted"] = store.index.compaction.delete_retired(grace_s=0)
    store.close()
    typer.echo(json.dumps(report))


@app.command()
def stats(root: RootOption = None, host: HostOption = None, port: PortOption = None, config: ConfigOption = None,
          backend: BackendOption = None, lake_catalog: LakeCatalogOption = None) -> None:
    """Print the store's stats as JSON: from the running server if one answers, else from the index offline
    when the root holds a store (backend lake: the replica's cache, brought up to date with the lake first).
    Creates nothing: with no server answering and no store at the root, it says so and exits 1."""
    settings = load_settings(config, root=root, host=host, port=port, backend=backend, lake_catalog=lake_catalog)
    try:
        response = httpx.get(f"http://{settings.host}:{settings.port}/v1/stats", timeout=5.0)
        response.raise_for_status()
        typer.echo(response.text)
        return
    except httpx.HTTPError:
        pass
    address = f"http://{settings.host}:{settings.port}"
    if not holds_store(settings.root):
        typer.echo(f"error: no store answers on {address}, and {settings.root} holds no store to read offline (no "
                   "index.duckdb or rollouts/): give --host/--port of a running store, or --root of one", err=True)
        raise typer.Exit(1)
    configure_logging(settings.log_level)
    store = open_store(settings, f"no server answered on {address} and ")
    typer.echo(store.stats().model_dump_json())
    store.close()


@app.command()
def migrate(
    source: Annotated[str, typer.Option(
        "--from", help="a store root, or a lake: 'ducklake:postgres:...' / 'ducklake:sqlite:...'")],
    target: Annotated[str, typer.Option("--to", help="a store root, or a lake (the other kind than --from)")],
    lake_data_path: Annotated[Optional[str], typer.Option(
        help="data path of a new lake (s3://bucket/prefix/ or a directory; default GRAFT_LAKE_DATA_PATH)")] = None,
    progress: Annotated[bool, typer.Option(help="show progress bars")] = True,
) -> None:
    """Copy a store between a local root and a lake, either way (S3 settings from AWS_* / GRAFT_LAKE_*).

    Idempotent: groups and problems the target holds are skipped, so an interrupted migration is run again.
    Stop a local store's server first, or migrate what its shards hold at the moment they are read.
    """
    from graft.services.store_api.lake.config import LakeConfig, LakeError
    from graft.services.store_api.lake.lake import Lake
    from graft.services.store_api.lake.migrate import lake_to_local, local_to_lake
    from graft.services.store_api.targets import is_lake_target

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
