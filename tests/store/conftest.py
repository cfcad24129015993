"""Fixtures of the store tests: real files under tmp_path, real servers on loopback."""

from __future__ import annotations

import itertools
import logging
import os
import re

import pytest

from graft.services.store_api.settings import StoreSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def settings(tmp_path) -> StoreSettings:
    return StoreSettings(root=tmp_path / "store", compact_interval_s=0, retired_grace_s=0.5)


# ---------------------------------------------------------------------------------------------- the lake backend
# A real PostgreSQL (Debian's server, started here as a plain user) and moto's S3 server on loopback, one each
# per test session; every test gets its own database and bucket prefix.


@pytest.fixture(scope="session")
def postgres():
    from testbed.lake_services import PostgresServer

    server = PostgresServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def moto_s3():
    from testbed.lake_services import MotoS3

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    with MotoS3() as s3:
        yield s3


def _lake_name(request) -> str:
    return "lake_" + re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[-40:].strip("_") + f"_{next(_lake_counter)}"


_lake_counter = itertools.count()


@pytest.fixture
def pg_s3_lake(postgres, moto_s3, request):
    """A new lake: catalog in PostgreSQL, data files in moto's S3 bucket (the many-hosts setup)."""
    from graft.services.store_api.lake.config import LakeConfig
    from testbed.lake_services import S3_KEY_ID, S3_SECRET

    name = _lake_name(request)
    return LakeConfig(catalog=f"ducklake:postgres:{postgres.create_database(name)}",
                      data_path=f"s3://{moto_s3.bucket}/{name}/", s3_endpoint=moto_s3.endpoint, s3_key_id=S3_KEY_ID,
                      s3_secret=S3_SECRET, s3_region="us-east-1")


@pytest.fixture
def sqlite_lake(tmp_path):
    """A new lake: catalog in SQLite, data files on a local path (the one-host setup)."""
    from graft.services.store_api.lake.config import LakeConfig

    return LakeConfig(catalog=f"ducklake:sqlite:{tmp_path / 'catalog.sqlite'}", data_path=f"{tmp_path / 'lake-data'}/")


@pytest.fixture(params=["postgres+s3", "sqlite+path"])
def any_lake(request):
    """Each lake setup in turn."""
    return request.getfixturevalue("pg_s3_lake" if request.param == "postgres+s3" else "sqlite_lake")
