"""The trainer's tests run their tiny models on one torch thread (fixtures of the toy world: tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_torch_thread):
    yield
