"""The verl tests run in verl's own environment (.venv-verl: `make install-verl`); in the project's .venv they skip.
`make test` runs them there with GRAFT_REQUIRE_VERL=1, under which a missing verl fails the run instead of skipping it."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray on loopback for the tests: no token written to ~/.ray


def pytest_configure(config):
    if os.environ.get("GRAFT_REQUIRE_VERL") and importlib.util.find_spec("verl") is None:
        raise pytest.UsageError("GRAFT_REQUIRE_VERL is set but verl is not importable: run these tests with "
                                ".venv-verl/bin/python (make install-verl builds it)")
