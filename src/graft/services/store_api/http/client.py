"""The store's HTTP client (`StoreClient`, httpx), with timeouts and retries: the trainer, the generator and the
integrations use it.

Bulk data travels as Arrow IPC both ways. Errors raise StoreError (status code and the server's message);
a store that cannot be reached after the retries raises StoreUnavailable. The sync client's peer lookup,
the trainer's hot call, goes over kept-alive `http.client` connections instead of httpx: ~0.25 ms of
client CPU per request on the 2-core VM against ~1 ms through httpx (whose HTTP parsing, h11, is Python).
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from graft.schemas import (
    ARROW_MEDIA_TYPE,
    HEARTBEAT_PATH,
    LEASE_PATH,
    LOOKUP_PATH,
    MAX_PUSH_GROUPS,
    PUSH_PATH,
    HealthResponse,
    Heartbeat,
    HeartbeatRequest,
    LeaseRequest,
    PeerLookupRequest,
    PeerLookupResponse,
    Problem,
    SERVED_PATH,
    WANTED_PATH,
    PushGroupsResponse,
    RolloutGroup,
    ServedRequest,
    ServedResponse,
    StatsResponse,
    WantedList,
    WantedPrompt,
    WantedRequest,
    WantedResponse,
    table_to_groups,
)
from graft.services.store_api.tables import groups_table

RETRY_STATUSES = {502, 503, 504}
# the server closed a kept-alive connection (idle timeout, restart): go again on a new one, no attempt lost
_STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class StoreError(Exception):
    """The store answered with an error; `status_code` and the server's `message`."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(f"{message} (HTTP {status_code})" if status_code else message)
        self.status_code = status_code
        self.message = message


class StoreUnavailable(StoreError):
    """The store could not be reached (connection refused, timeouts, 502-504) after every retry."""


def _error(response: httpx.Response) -> StoreError:
    try:
        message = response.json().get("error") or response.text
    except ValueError:
        message = response.text or response.reason_phrase
    return StoreError(f"{response.request.method} {response.request.url.path}: {message}", response.status_code)


def _read_arrow(response: httpx.Response | bytes) -> pa.Table:
    body = response if isinstance(response, bytes) else response.content
    return pa.ipc.open_stream(pa.py_buffer(body)).read_all()


def _error_message(body: bytes, fallback: str) -> str:
    try:
        return orjson.loads(body).get("error") or fallback
    except (orjson.JSONDecodeError, AttributeError):
        return body.decode(errors="replace") or fallback


def _retried_status(status: int, answer: Any) -> str:
    """A 502-504 answer as the last reason a call is retried for, with the server's message when it sent one (a
    lake replica says why the lake cannot be reached)."""
    body = answer.content if isinstance(answer, httpx.Response) else answer if isinstance(answer, bytes) else b""
    message = _error_message(body, "")
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


class _KeptAliveConnections:
    """http.client connections to one server, reused across requests; one per concurrent caller."""

    def __init__(self, base_url: str, timeout_s: float):
        url = urlsplit(base_url)
        self.connection_class = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self.host, self.port, self.prefix = url.hostname, url.port, url.path.rstrip("/")
        self.timeout_s = timeout_s
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """POST and return (status, body); raises OSError / http.client.HTTPException if the exchange fails."""
        with self._lock:
            connection = self._idle.pop() if self._idle else None
        reused = connection is not None
        if connection is None:
            connection = self.connection_class(self.host, self.port, timeout=self.timeout_s)
        try:
            connection.request("POST", self.prefix + path, body, headers)
            response = connection.getresponse()
            data = response.read()
        except _STALE_CONNECTION:
            connection.close()
            if reused:
                return self.post(path, body, headers)
            raise
        except BaseException:
            connection.close()
            raise
        if response.will_close:
            connection.close()
        else:
            with self._lock:
                self._idle.append(connection)
        return response.status, data

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def _metadata_json(table: pa.Table, key: str) -> Any:
    raw = (table.schema.metadata or {}).get(key.encode())
    return None if raw is None else orjson.loads(raw)


def _push_bodies(groups: list[RolloutGroup] | pa.Table, problems: list[Problem] | None) -> list[bytes]:
    """Arrow IPC bodies of at most MAX_PUSH_GROUPS groups of one model each; problems ride with the first."""
    table = groups if isinstance(groups, pa.Table) else groups_table(groups)
    bodies = []
    problems_json = orjson.dumps([p.model_dump() for p in problems or []])
    for model in pc.unique(table.column("model_id")).to_pylist():
        rows = table.filter(pc.equal(table.column("model_id"), model))
        group_ids = pc.unique(rows.column("group_id"))
        for start in range(0, len(group_ids), MAX_PUSH_GROUPS):
            chunk_ids = group_ids.slice(start, MAX_PUSH_GROUPS)
            chunk = rows.filter(pc.is_in(rows.column("group_id"), chunk_ids))
            metadata = {b"graft_problems": problems_json} if problems and not bodies else {}
            chunk = chunk.replace_schema_metadata({**(chunk.schema.metadata or {}), **metadata})
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, chunk.schema) as writer:
                writer.write_table(chunk)
            bodies.append(sink.getvalue().to_pybytes())
    return bodies


def _merge_pushes(responses: list[PushGroupsResponse]) -> PushGroupsResponse:
    shards = [r.shard for r in responses if r.shard]
    return PushGroupsResponse(
        accepted_groups=sum(r.accepted_groups for r in responses),
        duplicate_groups=[g for r in responses for g in r.duplicate_groups],
        shard=shards[-1] if shards else None,
    )


def _lookup_response(table: pa.Table, validate: bool) -> PeerLookupResponse:
    groups = table_to_groups(table, validate=validate)
    misses = _metadata_json(table, "misses") or []
    reasons = _metadata_json(table, "miss_reasons") or {}  # {} from a store older than the field
    if validate:
        return PeerLookupResponse(groups=groups, misses=misses, miss_reasons=reasons)
    return PeerLookupResponse.model_construct(groups=groups, misses=misses, miss_reasons=reasons)


class _RetryRule:
    """When the client tries a call again: after a transport error or a 502-504 answer, `retries` more times at
    most, waiting backoff_s, 2 * backoff_s, 4 * backoff_s, ... before each; then StoreUnavailable. Any other
    answer is final."""

    def __init__(self, base_url: str, retries: int, backoff_s: float):
        self.base_url = base_url
        self.retries = retries
        self.backoff_s = backoff_s

    def waits(self) -> Iterator[float]:
        """Seconds to wait before each attempt: none before the first."""
        for attempt in range(self.retries + 1):
            yield self.backoff_s * 2 ** (attempt - 1) if attempt else 0.0

    def unavailable(self, what: str, last: Exception | str) -> StoreUnavailable:
        return StoreUnavailable(f"store at {self.base_url} unreachable after {self.retries + 1} attempts ({what}): "
                                f"{last if isinstance(last, str) else repr(last)}")


def _rollout_params(filters: dict[str, Any], cursor: str | None, limit: int) -> dict[str, Any]:
    params = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in filters.items() if v is not None}
    params["limit"] = limit
    if cursor:
        params["cursor"] = cursor
    return params


class StoreClient:
    """Synchronous client. `retries` more attempts after the first on connection errors and 502-504."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.2):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._retry = _RetryRule(self.base_url, retries, backoff_s)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)
        self._lookups = _KeptAliveConnections(self.base_url, timeout_s)
        self._lookup_headers = {"Content-Type": "application/json", "Accept": ARROW_MEDIA_TYPE, **headers}

    def _attempt(self, what: str, send: Callable[[], tuple[int, Any]],
                 transport_errors: type[Exception] | tuple[type[Exception], ...]) -> tuple[int, Any]:
        """(status, answer) of the first `send()` that the retry rule does not try again."""
        last: Exception | str = ""
        for wait in self._retry.waits():
            if wait:
                time.sleep(wait)
            try:
                status, answer = send()
            except transport_errors as exc:
                last = exc
                continue
            if status not in RETRY_STATUSES:
                return status, answer
            last = _retried_status(status, answer)
        raise self._retry.unavailable(what, last)

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        def send() -> tuple[int, httpx.Response]:
            response = self._http.request(method, path, **kwargs)
            return response.status_code, response

        status, response = self._attempt(f"{method} {path}", send, httpx.TransportError)
        if status >= 400:
            raise _error(response)
        return response

    def health(self) -> HealthResponse:
        return HealthResponse.model_validate_json(self._request("GET", "/v1/health").content)

    def stats(self) -> StatsResponse:
        return StatsResponse.model_validate_json(self._request("GET", "/v1/stats").content)

    def lookup_peer_table(self, req: PeerLookupRequest) -> tuple[pa.Table, list[str]]:
        """Peer groups as an Arrow table of rollout rows (fastest), and the missed prompt ids."""
        # the fields left out at their defaults, so that a store older than them still answers
        leave_out = set() if req.require_behaviour_logprobs else {"require_behaviour_logprobs"}
        leave_out |= set() if req.order != "freshest" else {"order"}
        body = req.model_dump_json(exclude_none=True, exclude=leave_out).encode()
        status, data = self._attempt(f"POST {LOOKUP_PATH}",
                                     lambda: self._lookups.post(LOOKUP_PATH, body, self._lookup_headers),
                                     (OSError, http.client.HTTPException))
        if status >= 400:
            raise StoreError(f"POST {LOOKUP_PATH}: {_error_message(data, f'HTTP {status}')}", status)
        table = _read_arrow(data)
        return table, _metadata_json(table, "misses") or []

    def lookup_peer_groups(self, req: PeerLookupRequest, validate: bool = False) -> PeerLookupResponse:
        """Peer groups as models (built with model_construct unless `validate`)."""
        table, _ = self.lookup_peer_table(req)
        return _lookup_response(table, validate)

    def push_groups(self, groups: list[RolloutGroup] | pa.Table, problems: list[Problem] | None = None) -> PushGroupsResponse:
        """Store groups (any number, any models: split into pushes of one model and <= 512 groups)."""
        responses = [
            PushGroupsResponse.model_validate_json(self._request(
                "POST", PUSH_PATH, content=body, headers={"Content-Type": ARROW_MEDIA_TYPE}).content)
            for body in _push_bodies(groups, problems)
        ]
        return _merge_pushes(responses)

    def post_wanted(self, req: WantedRequest) -> WantedResponse:
        """Tell the store which prompts a learner missed (they become the generators' work)."""
        return WantedResponse.model_validate_json(self._request(
            "POST", WANTED_PATH, content=req.model_dump_json(exclude_none=True),
            headers={"Content-Type": "application/json"}).content)

    def wanted(self, model: str | None = None, order: str = "oldest", limit: int = 64,
               cursor: str | None = None) -> WantedList:
        """One page of the prompts learners other than `model` want (and whose rules take `model`'s groups), with
        their problems; its `next_cursor` gives the next page."""
        params = {"order": order, "limit": limit} | ({"model": model} if model else {}) | ({"cursor": cursor} if cursor else {})
        return WantedList.model_validate_json(self._request("GET", WANTED_PATH, params=params).content)

    def all_wanted(self, model: str | None = None, order: str = "oldest", page: int = 1024) -> list[WantedPrompt]:
        """Every prompt `wanted` lists, page after page."""
        prompts, cursor = [], None
        while True:
            listed = self.wanted(model, order, page, cursor)
            prompts += listed.prompts
            cursor = listed.next_cursor
            if cursor is None:
                return prompts

    def lease_wanted(self, req: LeaseRequest) -> WantedList:
        """Wanted prompts leased to this generator alone (a generator's work; another gets others meanwhile)."""
        return WantedList.model_validate_json(self._request(
            "POST", LEASE_PATH, content=req.model_dump_json(), headers={"Content-Type": "application/json"}).content)

    def beat(self, req: HeartbeatRequest) -> None:
        """Tell the store this trainer lives (lockstep co-training)."""
        self._request("POST", HEARTBEAT_PATH, content=req.model_dump_json(), headers={"Content-Type": "application/json"})

    def heartbeats(self, models: list[str]) -> dict[str, Heartbeat]:
        """The last heartbeat of each of `models` that the store holds."""
        answer = orjson.loads(self._request("GET", HEARTBEAT_PATH, params=[("model", m) for m in models]).content)
        return {model: Heartbeat.model_validate(beat) for model, beat in answer.items()}

    def record_served(self, req: ServedRequest) -> ServedResponse:
        """Ledger entries: the groups a learner grafted at a step."""
        return ServedResponse.model_validate_json(self._request(
            "POST", SERVED_PATH, content=req.model_dump_json(), headers={"Content-Type": "application/json"}).content)

    def times_served(self, group_id: str) -> dict[str, int]:
        """learner -> times the group was served to it."""
        return orjson.loads(self._request("GET", f"/v1/groups/{quote(group_id, safe='')}/served").content)

    def get_group(self, group_id: str) -> RolloutGroup | None:
        try:
            response = self._request("GET", f"/v1/groups/{quote(group_id, safe='')}", headers={"Accept": ARROW_MEDIA_TYPE})
        except StoreError as exc:
            if exc.status_code == 404:
                return None
            raise
        return table_to_groups(_read_arrow(response))[0]

    def prompt_groups(self, prompt_id: str, model: str | None = None, limit: int = 16) -> list[RolloutGroup]:
        params = {"limit": limit, **({"model": model} if model else {})}
        response = self._request("GET", f"/v1/prompts/{prompt_id}/groups", params=params,
                                 headers={"Accept": ARROW_MEDIA_TYPE})
        return table_to_groups(_read_arrow(response))

    def rollouts_page(self, cursor: str | None = None, limit: int = 1000, **filters) -> tuple[pa.Table, str | None]:
        """One page of GET /v1/rollouts as an Arrow table, and the next cursor (None on the last page)."""
        response = self._request("GET", "/v1/rollouts", params=_rollout_params(filters, cursor, limit),
                                 headers={"Accept": ARROW_MEDIA_TYPE})
        table = _read_arrow(response)
        return table, _metadata_json(table, "next_cursor")

    def iter_rollouts(self, limit: int = 1000, **filters) -> Iterator[pa.Table]:
        """Every page of GET /v1/rollouts with these filters (model, prompt_id, dataset, correct, ...)."""
        cursor = None
        while True:
            table, cursor = self.rollouts_page(cursor, limit, **filters)
            yield table
            if cursor is None:
                return

    def close(self) -> None:
        self._http.close()
        self._lookups.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

