"""The HTTP API on a real server (uvicorn on 127.0.0.1, real files): round trips, errors, auth, freshness."""

from __future__ import annotations

import io
import statistics
import time

import httpx
import orjson
import pyarrow as pa
import pytest
from store_factory import make_group, make_problem, problem_text

from graft.schemas import ErrorResponse, PeerLookupRequest, RolloutGroup, groups_to_table, prompt_id, table_to_groups
from graft.services.store_api.http.client import StoreClient, StoreError, StoreUnavailable
from graft.services.store_api.http.testing import StoreServer, free_port
from graft.services.store_api.local.shards import write_groups

ARROW = "application/vnd.apache.arrow.stream"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api") / "store"
    write_groups(root, [make_group(i, "peer", step=2, size=8) for i in range(20)])
    with StoreServer(root, env={"GRAFT_STORE_MAX_REQUEST_KB": "64"}) as srv:
        yield srv


@pytest.fixture
def client(server):
    with StoreClient(server.url) as c:
        yield c


def test_push_then_lookup_round_trip(client, server):
    groups = [make_group(100 + i, "learner", step=5, size=8) for i in range(12)]
    response = client.push_groups(groups, problems=[make_problem(100 + i) for i in range(12)])
    assert response.accepted_groups == 12 and response.duplicate_groups == []
    assert (server.root / response.shard).is_file()
    assert list((server.root / "prompts" / "dataset=toy-math").glob("part-*.parquet"))

    again = client.push_groups(groups[:3] + [make_group(200, "learner")])
    assert again.accepted_groups == 1 and sorted(again.duplicate_groups) == sorted(g.group_id for g in groups[:3])

    found = client.lookup_peer_groups(
        PeerLookupRequest(prompt_ids=[groups[4].prompt_id, "f" * 16], learner_model="peer"), validate=True)
    assert found.groups == [groups[4]]  # whole group, every stored field
    assert found.misses == ["f" * 16]
    assert client.get_group(groups[7].group_id) == groups[7]
    assert client.get_group("no-such-group") is None
    assert client.prompt_groups(groups[2].prompt_id) == [groups[2]]


def test_json_and_arrow_answers_agree(client, server):
    body = {"prompt_ids": [prompt_id(problem_text(i)) for i in (1, 2, 3, 999)], "learner_model": "learner"}
    as_json = httpx.post(f"{server.url}/v1/peer-groups/lookup", json=body)
    assert as_json.status_code == 200 and as_json.headers["content-type"] == "application/json"
    payload = as_json.json()
    from_json = [RolloutGroup.model_validate(g) for g in payload["groups"]]
    table, misses = client.lookup_peer_table(PeerLookupRequest(**body))
    assert from_json == table_to_groups(table) and len(from_json) == 3
    assert payload["misses"] == misses == [prompt_id(problem_text(999))]

    page = httpx.get(f"{server.url}/v1/rollouts", params={"model": "peer", "limit": 5}).json()
    assert len(page["rollouts"]) == 5 and page["next_cursor"]
    rows = [r for t in client.iter_rollouts(limit=64, model="peer") for r in t.to_pylist()]
    assert len(rows) == 160 and len({r["rollout_id"] for r in rows}) == 160
    group = httpx.get(f"{server.url}/v1/groups/{from_json[0].group_id}").json()
    assert RolloutGroup.model_validate(group) == from_json[0]


def test_stats_and_health(client):
    health = client.health()
    assert health.status == "ok" and health.groups >= 20
    stats = client.stats()
    peer = next(m for m in stats.models if m.model_id == "peer")
    assert (peer.groups, peer.rollouts, peer.prompts, peer.max_policy_step) == (20, 160, 20, 2)
    assert peer.success_rate == pytest.approx(0.5) and peer.informative_groups == 20
    assert stats.files >= 1 and stats.last_ingest_at is not None


def test_a_landed_shard_is_queryable_within_a_second(client, server):
    delays = []
    for i in range(3):
        group = make_group(400 + i, "fresh-model")
        write_groups(server.root, [group])
        landed = time.perf_counter()
        req = PeerLookupRequest(prompt_ids=[group.prompt_id], learner_model="nobody")
        while not client.lookup_peer_groups(req).groups:
            assert time.perf_counter() - landed < 5
            time.sleep(0.01)
        delays.append(time.perf_counter() - landed)
    assert statistics.median(delays) < 1.0, delays


def _arrow_body(group: RolloutGroup, **changes) -> bytes:
    table = groups_to_table([group])
    for name, value in changes.items():
        table = table.set_column(table.schema.get_field_index(name), name, pa.array([value] * table.num_rows, table.schema.field(name).type))
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


BAD_REQUESTS = [
    ("POST", "/v1/peer-groups/lookup", {"json": {"prompt_ids": [], "learner_model": "a"}}, 422, "prompt_ids"),
    ("POST", "/v1/peer-groups/lookup", {"json": {"prompt_ids": ["a"] * 1025, "learner_model": "a"}}, 422, "at most 1024"),
    ("POST", "/v1/peer-groups/lookup", {"json": {"prompt_ids": ["a"]}}, 422, "learner_model"),
    ("POST", "/v1/peer-groups/lookup", {"json": {"prompt_ids": ["a"], "learner_model": "a", "groups_per_prompt": 0}}, 422, "groups_per_prompt"),
    ("POST", "/v1/peer-groups/lookup", {"json": {"prompt_ids": ["a"], "learner_model": "a", "bogus": 1}}, 422, "bogus"),
    ("POST", "/v1/peer-groups/lookup", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, "JSON"),
    ("POST", "/v1/peer-groups/lookup", {"content": b"x" * 70_000, "headers": {"content-type": "application/json"}}, 413, "exceeds"),
    ("GET", "/v1/prompts/NOT-HEX/groups", {}, 422, "prompt_id"),
    ("GET", "/v1/rollouts", {"params": {"limit": 5000}}, 422, "limit"),
    ("GET", "/v1/rollouts", {"params": {"cursor": "garbage"}}, 400, "cursor"),
    ("GET", "/v1/rollouts", {"params": {"min_reward": 0.9, "max_reward": 0.1}}, 422, "empty"),
    ("GET", "/v1/rollouts", {"params": {"correct": "maybe"}}, 422, "correct"),
    ("GET", "/v1/groups/unknown-group", {}, 404, "unknown-group"),
    ("GET", "/v1/no-such-endpoint", {}, 404, "no such endpoint"),
    ("DELETE", "/v1/stats", {}, 405, "not allowed"),
    ("POST", "/v1/groups", {"json": {"groups": []}}, 422, "groups"),
    ("POST", "/v1/groups", {"content": b"abc", "headers": {"content-type": "text/plain"}}, 415, "Content-Type"),
    ("POST", "/v1/groups", {"content": b"abc", "headers": {"content-type": ARROW}}, 400, "Arrow IPC"),
    ("POST", "/v1/groups", {"content": _arrow_body(make_group(1, "m"), top_p=2.0), "headers": {"content-type": ARROW}}, 422, "top_p"),
    ("POST", "/v1/groups", {"json": {"groups": [orjson.loads(make_group(1, "m").model_dump_json())], "extra": 1}}, 422, "extra"),
]


@pytest.mark.parametrize("method,path,kwargs,status,words", BAD_REQUESTS, ids=[f"{m} {p} {s} {w}" for m, p, _, s, w in BAD_REQUESTS])
def test_bad_requests_get_clear_4xx(server, method, path, kwargs, status, words):
    response = httpx.request(method, server.url + path, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = ErrorResponse.model_validate(response.json())
    assert words.lower() in error.error.lower(), error.error


def test_arrow_lookups_answer_like_json_ones_and_bad_ones_get_the_same_errors(server):
    url = f"{server.url}/v1/peer-groups/lookup"
    body = {"prompt_ids": [prompt_id(problem_text(i)) for i in (3, 998, 1)], "learner_model": "learner"}
    as_json = httpx.post(url, json=body).json()
    as_arrow = httpx.post(url, json=body, headers={"accept": ARROW})  # answered by the fast path
    table = pa.ipc.open_stream(as_arrow.content).read_all()
    assert as_arrow.headers["content-type"] == ARROW
    assert table_to_groups(table) == [RolloutGroup.model_validate(g) for g in as_json["groups"]]
    assert orjson.loads(table.schema.metadata[b"misses"]) == as_json["misses"] == [prompt_id(problem_text(998))]
    for bad, words in (({"prompt_ids": [], "learner_model": "a"}, "prompt_ids"),
                       ({"prompt_ids": ["a"], "learner_model": "a", "bogus": 1}, "bogus")):
        with_arrow = httpx.post(url, json=bad, headers={"accept": ARROW})
        without = httpx.post(url, json=bad)
        assert with_arrow.status_code == without.status_code == 422
        assert with_arrow.json() == without.json() and words in with_arrow.json()["error"]
    # a body of another content type is not read as JSON, with or without the fast path
    as_text = httpx.post(url, content=orjson.dumps(body), headers={"accept": ARROW, "content-type": "text/plain"})
    assert as_text.status_code == 422


def test_client_lookup_reconnects_after_a_restart_and_carries_errors(tmp_path):
    group = make_group(1, "peer", size=8)
    write_groups(tmp_path / "store", [group])
    server = StoreServer(tmp_path / "store").start()
    req = PeerLookupRequest(prompt_ids=[group.prompt_id], learner_model="learner")
    try:
        with StoreClient(server.url, retries=0) as client:
            assert client.lookup_peer_groups(req, validate=True).groups == [group]
            server.stop()
            server.start()  # the client's kept-alive connection is dead now: no retry may be needed
            assert client.lookup_peer_groups(req, validate=True).groups == [group]
            with pytest.raises(StoreError) as info:
                client.lookup_peer_table(PeerLookupRequest.model_construct(prompt_ids=[], learner_model="a"))
            assert info.value.status_code == 422 and "prompt_ids" in info.value.message
            server.stop()
            with pytest.raises(StoreUnavailable, match="1 attempts"):
                client.lookup_peer_table(req)
    finally:
        server.stop()


def test_client_errors_carry_status_and_message(client):
    with pytest.raises(StoreError) as info:
        client.prompt_groups("zz")
    assert info.value.status_code == 422 and "prompt_id" in info.value.message
    dead = StoreClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.01, timeout_s=1)
    started = time.perf_counter()
    with pytest.raises(StoreUnavailable, match="3 attempts"):
        dead.health()
    assert time.perf_counter() - started < 5


def test_writes_need_the_token_when_one_is_set(tmp_path):
    with StoreServer(tmp_path / "store", token="s3cret") as srv:
        group = make_group(1, "model-a")
        for token, words in ((None, "requires a bearer token"), ("wrong", "wrong bearer token")):
            with StoreClient(srv.url, token=token) as c, pytest.raises(StoreError) as info:
                c.push_groups([group])
            assert info.value.status_code == 401 and words in info.value.message
        with StoreClient(srv.url, token="s3cret") as c:
            assert c.push_groups([group]).accepted_groups == 1
            assert c.get_group(group.group_id) == group  # reads stay open
        with StoreClient(srv.url) as c:
            assert c.stats().total_groups == 1


def test_an_empty_token_is_refused_at_start(monkeypatch):
    """GRAFT_STORE_TOKEN set but empty (compose's `${GRAFT_STORE_TOKEN:-}`) would require a token no client sends and
    lock every writer out with 401s: refused when the settings are read, naming the field."""
    from pydantic import ValidationError

    from graft.services.store_api.settings import StoreSettings

    monkeypatch.setenv("GRAFT_STORE_TOKEN", "")
    with pytest.raises(ValidationError, match="token"):
        StoreSettings()
    monkeypatch.setenv("GRAFT_STORE_TOKEN", "s3cret")
    assert StoreSettings().token == "s3cret"


def test_a_lookup_says_why_each_missed_prompt_got_nothing(tmp_path):
    """Nothing stored, only the learner's own groups, only peers the request does not admit, only uninformative
    groups: four misses, four reasons, alike in the JSON answer, the Arrow fast path's metadata and the client's."""
    root = tmp_path / "store"
    write_groups(root, [make_group(301, "learner", step=3)])  # the learner's own, informative
    write_groups(root, [make_group(302, "old-peer", step=1)])  # a peer below min_policy_step
    write_groups(root, [make_group(303, "peer", step=5, rewards=[0.0] * 4)])  # all-fail
    write_groups(root, [make_group(303, "learner", step=5)])
    write_groups(root, [make_group(304, "peer", step=5)])  # the one that answers
    ids = {i: prompt_id(problem_text(i)) for i in (300, 301, 302, 303, 304)}
    body = {"prompt_ids": list(ids.values()), "learner_model": "learner", "min_policy_step": 2}
    expected = {ids[300]: "nothing_stored", ids[301]: "only_learner", ids[302]: "peers_not_admitted",
                ids[303]: "only_uninformative"}
    with StoreServer(root) as srv:
        url = f"{srv.url}/v1/peer-groups/lookup"
        as_json = httpx.post(url, json=body).json()
        as_arrow = pa.ipc.open_stream(httpx.post(url, json=body, headers={"accept": ARROW}).content).read_all()
        with StoreClient(srv.url) as client:
            found = client.lookup_peer_groups(PeerLookupRequest(**body), validate=True)
    assert as_json["misses"] == list(expected) == found.misses  # `misses` as before: the prompts with nothing
    assert as_json["miss_reasons"] == expected == orjson.loads(as_arrow.schema.metadata[b"miss_reasons"])
    assert found.miss_reasons == expected and [g.prompt_id for g in found.groups] == [ids[304]]
