"""Where a lake lives and how to reach it (`LakeConfig`), the lake's errors, and DuckDB's lake extensions.

No extension is downloaded at run time: DuckDB is pinned to the version whose extensions are published as
PyPI wheels (the `lake` extra), `duckdb_extensions.import_extension` installs each from its wheel, then it
is loaded by name, with DuckDB's auto-install and auto-load off.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import TYPE_CHECKING, Literal

import duckdb
from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from graft.services.store_api.targets import LAKE_PREFIX

if TYPE_CHECKING:
    from graft.services.store_api.settings import StoreSettings

PINNED_DUCKDB = "1.5.5"
# module name of duckdb_extensions' wheel -> the name the extension loads as
EXTENSIONS = {"ducklake": "ducklake", "httpfs": "httpfs", "postgres": "postgres_scanner", "sqlite": "sqlite_scanner"}
NO_PROGRESS_BAR = "SET enable_progress_bar = false"  # long reads would draw one on a server's stdout


class LakeError(RuntimeError):
    """A lake operation failed; the message says what and what to do."""


class LakeUnavailable(LakeError):
    """The catalog or the data files cannot be reached (down, wrong address, wrong credentials)."""


class ExtensionMissing(LakeError):
    """DuckDB or one of its lake extensions is missing or of another version than the pinned one."""


# ---------------------------------------------------------------------------------------------- configuration


class LakeConfig(BaseSettings):
    """Where a lake lives and how to reach it: GRAFT_LAKE_<FIELD>, and the usual AWS_* variables for S3."""

    model_config = SettingsConfigDict(env_prefix="GRAFT_LAKE_", extra="forbid", populate_by_name=True)

    catalog: str = Field(repr=False, description="DuckLake catalog: 'ducklake:postgres:dbname=... host=... user=...' "
                                                 "(many hosts) or 'ducklake:sqlite:/path/catalog.sqlite' (one host)")
    data_path: str | None = Field(default=None, description="where a new lake puts its Parquet files: s3://bucket/prefix/ "
                                                            "or a shared directory (an existing lake remembers its own)")
    s3_endpoint: str | None = Field(default=None, validation_alias=AliasChoices(
        "s3_endpoint", "GRAFT_LAKE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        description="S3-compatible endpoint, e.g. http://127.0.0.1:9000 (default: AWS)")
    s3_region: str = Field(default="us-east-1", validation_alias=AliasChoices(
        "s3_region", "GRAFT_LAKE_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"), description="S3 region")
    s3_key_id: str | None = Field(default=None, validation_alias=AliasChoices(
        "s3_key_id", "GRAFT_LAKE_S3_KEY_ID", "AWS_ACCESS_KEY_ID"), description="S3 access key id")
    s3_secret: str | None = Field(default=None, repr=False, validation_alias=AliasChoices(
        "s3_secret", "GRAFT_LAKE_S3_SECRET", "AWS_SECRET_ACCESS_KEY"), description="S3 secret access key")
    s3_session_token: str | None = Field(default=None, repr=False, validation_alias=AliasChoices(
        "s3_session_token", "GRAFT_LAKE_S3_SESSION_TOKEN", "AWS_SESSION_TOKEN"), description="S3 session token")
    s3_url_style: Literal["path", "vhost"] | None = Field(default=None, description="S3 addressing; default: path "
                                                                                   "with an endpoint, else vhost")
    memory_limit: str = Field(default="512MB", description="DuckDB memory limit of a lake connection")
    # one thread: a commit of 8192 rollouts (Parquet encoding and upload) cost 27 us of CPU per rollout on one
    # thread and 55 on two; writers scale by running more processes
    threads: int = Field(default=1, ge=1, description="DuckDB threads of a lake connection")
    file_cache: bool = Field(default=True, description="keep data files' blocks in DuckDB's memory (writers re-read the "
                                                       "group ids of every commit; a replica reads each file once)")

    @field_validator("catalog")
    @classmethod
    def _catalog_kind(cls, value: str) -> str:
        value = value.strip()
        if not value.startswith(LAKE_PREFIX):
            value = LAKE_PREFIX + value
        kind = value[len(LAKE_PREFIX):].split(":", 1)[0]
        if kind not in ("postgres", "sqlite"):
            raise ValueError(f"lake catalog {redact(value)!r}: use 'ducklake:postgres:<libpq connection string>' "
                             "(many hosts) or 'ducklake:sqlite:<path>' (one host); a DuckDB-file catalog admits one "
                             "process only")
        return value

    @property
    def kind(self) -> str:
        return self.catalog[len(LAKE_PREFIX):].split(":", 1)[0]

    def env(self) -> dict[str, str]:
        """This config as GRAFT_LAKE_* variables, for another process (`LakeConfig()` there reads them back)."""
        return {f"GRAFT_LAKE_{name.upper()}": str(value) for name, value in self.model_dump().items() if value is not None}

    def describe(self) -> str:
        """The catalog with any password hidden, and the data path: for messages and logs."""
        return f"{redact(self.catalog)} (data {self.data_path or 'as the catalog says'})"



    @classmethod
    def of_replica(cls, settings: StoreSettings) -> LakeConfig:
        """The LakeConfig of a store replica (backend 'lake'; S3 endpoint and credentials from the environment)."""
        # a replica's lake connection reads a window at a time (each data file once: no file cache); the index's
        # memory limit bounds it too
        return cls(catalog=settings.lake_catalog, memory_limit=settings.duckdb_memory_limit, file_cache=False,
                   **({"data_path": settings.lake_data_path} if settings.lake_data_path else {}))


def redact(text: str) -> str:
    """Hide passwords in libpq connection strings and URLs."""
    text = re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", text, flags=re.IGNORECASE)
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


# ---------------------------------------------------------------------------------------------- extensions


def check_duckdb_version() -> None:
    if duckdb.__version__ != PINNED_DUCKDB:
        raise ExtensionMissing(
            f"duckdb {duckdb.__version__} is installed; the lake needs duckdb=={PINNED_DUCKDB}, the version whose "
            f"extensions are published as PyPI wheels: pip install 'duckdb=={PINNED_DUCKDB}' (or `pip install -e .[lake]`)")


def load_extensions(con: duckdb.DuckDBPyConnection) -> None:
    """Install the lake's extensions from their PyPI wheels into `con`'s database, then load them.

    Raises ExtensionMissing naming the package to install when a wheel is missing or of another version.
    """
    check_duckdb_version()
    try:
        from duckdb_extensions import import_extension
    except ImportError as exc:
        raise ExtensionMissing(f"the lake needs duckdb-extensions=={PINNED_DUCKDB} and its extension wheels: "
                               "pip install -e '.[lake]'") from exc
    for module, load_name in EXTENSIONS.items():
        package = f"duckdb-extension-{module}"
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise ExtensionMissing(f"DuckDB extension {module!r} is not installed: pip install '{package}=={PINNED_DUCKDB}' "
                                   "(or pip install -e '.[lake]'); extensions are never downloaded at run time") from None
        if installed != PINNED_DUCKDB:
            raise ExtensionMissing(f"{package} {installed} is installed, DuckDB is {PINNED_DUCKDB}: "
                                   f"pip install '{package}=={PINNED_DUCKDB}'")
        try:
            import_extension(module, con=con)  # INSTALL from the wheel's file; does not load
            con.execute(f"LOAD {load_name}")
        except (duckdb.Error, OSError, ModuleNotFoundError) as exc:
            raise ExtensionMissing(f"cannot load DuckDB extension {module!r} from {package}: {exc}; reinstall it: "
                                   f"pip install --force-reinstall '{package}=={PINNED_DUCKDB}'") from exc


def lake_connection(config: LakeConfig) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the lake's extensions loaded and S3 credentials set (not attached)."""
    con = duckdb.connect(config={
        "autoinstall_known_extensions": False, "autoload_known_extensions": False,
        "memory_limit": config.memory_limit, "threads": config.threads,
    })
    try:
        con.execute(NO_PROGRESS_BAR)
        load_extensions(con)
        con.execute("SET ducklake_max_retry_count = 100")  # many writers: a lost race is retried, not an error
        # hand freed memory back after each read: a replica reading 8192-rollout commits peaked at 950 MB with the
        # defaults (128/512 MB) and 710 MB with these
        con.execute("SET allocator_flush_threshold = '16MB'")
        con.execute("SET allocator_bulk_deallocation_flush_threshold = '16MB'")
        con.execute(f"SET enable_external_file_cache = {str(config.file_cache).lower()}")
        con.execute("SET TimeZone = 'UTC'")
        if config.s3_endpoint or config.s3_key_id:
            con.execute(s3_secret_sql(config))
    except BaseException:
        con.close()
        raise
    return con


def s3_secret_sql(config: LakeConfig) -> str:
    """CREATE SECRET for the data files on S3 (DuckDB's httpfs), from the config's endpoint and credentials."""
    def quote(value: str) -> str:
        return "'" + value.replace("'", "''") + "'"

    parts = ["TYPE s3", f"REGION {quote(config.s3_region)}"]
    if config.s3_key_id:
        parts += [f"KEY_ID {quote(config.s3_key_id)}", f"SECRET {quote(config.s3_secret or '')}"]
        if config.s3_session_token:
            parts.append(f"SESSION_TOKEN {quote(config.s3_session_token)}")
    url_style = config.s3_url_style
    if config.s3_endpoint:
        endpoint = config.s3_endpoint.rstrip("/")
        use_ssl = not endpoint.startswith("http://")
        endpoint = re.sub(r"^https?://", "", endpoint)
        parts += [f"ENDPOINT {quote(endpoint)}", f"USE_SSL {'true' if use_ssl else 'false'}"]
        url_style = url_style or "path"
    if url_style:
        parts.append(f"url_style {quote(url_style)}")  # DuckDB reads secret keys in any case
    return f"CREATE OR REPLACE SECRET graft_lake_s3 ({', '.join(parts)})"
