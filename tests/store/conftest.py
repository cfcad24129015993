"""Fixtures of the store tests: real files under tmp_path, real servers on loopback."""

from __future__ import annotations

import os

import pytest

from services.store_api.settings import StoreSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def settings(tmp_path) -> StoreSettings:
    return StoreSettings(root=tmp_path / "store", compact_interval_s=0, retired_grace_s=0.5)
