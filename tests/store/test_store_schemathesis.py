"""Property-based run against the live /openapi.json: no 5xx, every response as documented.

Schemathesis' pytest plugin does not load under pytest 9 here, so each operation runs its own hypothesis
loop over `operation.as_strategy()` (valid and invalid requests) and checks every response.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from store_factory import make_group

from graft.services.store_api.http.app import create_app
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local.shards import write_groups
from graft.services.store_api.settings import StoreSettings

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
OPENAPI = create_app(StoreSettings(root="unused")).openapi()
# (method, path, mode): invalid requests only where there is something to get wrong (parameters or a body)
OPERATIONS = [
    (method.upper(), path, mode)
    for path, methods in OPENAPI["paths"].items() for method, spec in methods.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or spec.get("parameters") or spec.get("requestBody")
]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "store"
    write_groups(root, [make_group(i, "peer", step=1) for i in range(5)])
    with StoreServer(root) as server:  # no token: the push body gets fuzzed too (auth is tested in test_store_api)
        yield server


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(f"{live_server.url}/openapi.json")


@pytest.mark.parametrize("method,path,mode", OPERATIONS, ids=[f"{m} {p} {g.value}" for m, p, g in OPERATIONS])
def test_openapi_contract(api_schema, live_server, method, path, mode):
    operation = api_schema[path][method]
    statuses: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def run(case):
        response = case.call(base_url=live_server.url, timeout=30)
        case.validate_response(response, checks=CHECKS)
        statuses.append(response.status_code)
        if response.status_code >= 400:
            assert response.json()["error"], response.text  # every error says what was wrong

    run()
    assert statuses and max(statuses) < 500
