"""Issue 13, item by item, on real servers and real files: bad Arrow bodies, big integers, the folder's side door,
unsafe folders, compaction errors, auth before the body, rollout and group ids, and the smaller rules."""

from __future__ import annotations

import io
import logging
import socket
import time
from datetime import datetime, timedelta, timezone

import httpx
import orjson
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from store_factory import make_group, make_problem

from graft.schemas import ROLLOUT_ARROW_SCHEMA, RolloutGroup, groups_to_table
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local.index import StoreIndex
from graft.services.store_api.local.lookup import lookup_path
from graft.services.store_api.local.shards import write_groups

ARROW = "application/vnd.apache.arrow.stream"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening") / "store"
    write_groups(root, [make_group(i, "peer", step=2) for i in range(4)])
    with StoreServer(root) as srv:
        yield srv


def arrow_body(table: pa.Table, **options) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        writer.write_table(table)
    return sink.getvalue()


def push_arrow(server: StoreServer, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/groups", content=body, headers={"content-type": ARROW}, timeout=60)


def push_json(server: StoreServer, groups: list[RolloutGroup] | list[dict], problems: list | None = None) -> httpx.Response:
    payload = {"groups": [orjson.loads(g.model_dump_json()) if isinstance(g, RolloutGroup) else g for g in groups]}
    if problems is not None:
        payload["problems"] = problems
    return httpx.post(f"{server.url}/v1/groups", content=orjson.dumps(payload),
                      headers={"content-type": "application/json"}, timeout=60)


def group_dict(group: RolloutGroup, **changes) -> dict:
    """The group as JSON with `changes` applied to every rollout."""
    return {"rollouts": [{**orjson.loads(r.model_dump_json()), **changes} for r in group.rollouts]}


# ------------------------------------------------------------------ 1-2: Arrow bodies that do not decode


def test_arrow_bodies_that_do_not_decode_get_400_and_the_server_lives(server):
    table = groups_to_table([make_group(1, "arrow-bad", seed=1)])
    plain = pa.schema([f.remove_metadata() for f in table.schema])  # no descriptions: names appear once
    body = arrow_body(table.cast(plain))
    bad_utf8 = table.set_column(1, "group_id", pa.array([b"g\xff\xfe"] * table.num_rows, pa.binary()).view(pa.string()))
    cases = {
        "a field name that is not UTF-8": body.replace(b"group_id", b"group_i\xff", 1),
        "a string value that is not UTF-8": arrow_body(bad_utf8),
        "a compressed body (12 KB can decompress to gigabytes)": arrow_body(table, compression="zstd"),
        "a truncated body": body[: len(body) // 2],
        "no body": b"",
    }
    for what, bad in cases.items():
        response = push_arrow(server, bad)
        assert response.status_code == 400, (what, response.status_code, response.text)
        assert "Arrow" in response.json()["error"], (what, response.json())
    assert httpx.get(f"{server.url}/v1/health").json()["status"] == "ok"
    assert push_arrow(server, body).status_code == 200  # the same rows, well formed, go in


# ------------------------------------------------------------------ 3: integers beyond 64 bits


def test_integers_beyond_64_bits_get_4xx_not_500(server):
    url = f"{server.url}/v1/rollouts"
    for params in ({"min_policy_step": 2**70}, {"max_policy_step": 2**64}, {"min_policy_step": 2**63}):
        response = httpx.get(url, params=params)
        assert response.status_code == 422, (params, response.text)
        assert "policy_step" in response.json()["error"]
    import base64
    for seq, row in ((2**70, 0), (1, 2**64)):
        cursor = base64.urlsafe_b64encode(f"{seq}:{row}".encode()).decode().rstrip("=")
        response = httpx.get(url, params={"cursor": cursor})
        assert response.status_code == 400 and "cursor" in response.json()["error"], response.text
    lookup = {"prompt_ids": ["0" * 16], "learner_model": "x", "min_policy_step": 2**70}
    assert httpx.post(f"{server.url}/v1/peer-groups/lookup", json=lookup).status_code == 422
    assert httpx.get(url, params={"min_policy_step": 2**63 - 1}).status_code == 200


# ------------------------------------------------------------------ 4: the folder's side door checks values

BAD_VALUES = {
    "reward 7.5": (lambda r: {**r, "reward": 7.5}, "reward"),
    "a NaN logprob": (lambda r: {**r, "token_logprobs": [5.0, float("nan")] + r["token_logprobs"][2:]}, "token_logprobs"),
    "advantage inf": (lambda r: {**r, "advantage": float("inf")}, "advantage"),
    "num_tokens -3": (lambda r: {**r, "num_tokens": -3}, "num_tokens"),
    "finish_reason 'exploded'": (lambda r: {**r, "finish_reason": "exploded"}, "finish_reason"),
    "ids and logprobs of different lengths": (lambda r: {**r, "token_logprobs": r["token_logprobs"][:-1]}, "same length"),
    "a NaN reward": (lambda r: {**r, "reward": float("nan")}, "reward"),
    "created_at in year 9999": (lambda r: {**r, "created_at": datetime(9999, 1, 1, tzinfo=timezone.utc)}, "created_at"),
    # a row without behaviour logprobs (logprobs_mode 'none') that holds some, or sits in a group with mu
    "mode none with logprobs": (lambda r: {**r, "logprobs_mode": "none", "logprob_sum": None}, "token_logprobs is not empty"),
    "mode none in a group with mu": (lambda r: {**r, "logprobs_mode": "none", "token_logprobs": [], "logprob_sum": None},
                                     "mixes rows with logprobs_mode 'none'"),
}


@pytest.mark.parametrize("what", list(BAD_VALUES))
def test_a_shard_from_the_folder_passes_the_rules_of_a_push_or_is_quarantined(settings, what):
    change, words = BAD_VALUES[what]
    root = settings.root
    good = write_groups(root, [make_group(i, "side", seed=i) for i in range(3)])
    rows = groups_to_table([make_group(10 + i, "side", seed=10 + i) for i in range(2)]).to_pylist()
    rows[1] = change(rows[1])
    bad = root / "rollouts" / "model=side" / "part-99990101T000000Z-foreign.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA), bad)  # schema-valid, plain pyarrow
    index = StoreIndex(settings).open()
    try:
        assert not bad.exists() and good.exists()
        reasons = [p.read_text() for p in (root / "quarantine").glob("*.reason.txt")]
        assert len(reasons) == 1 and words in reasons[0], reasons
        stats = index.queries.stats()
        assert stats.total_groups == 3 and stats.quarantined_files == 1
        assert stats.models[0].success_rate == pytest.approx(0.5)  # never null from a bad value
    finally:
        index.close()


def test_a_graft_shard_rewritten_after_its_writer_checked_it_is_checked_whole_again(settings):
    """The writer's lookup file vouches only for the shard whose footer it records: rewrite the shard (a NaN
    logprob, a column only a whole check decodes) and keep the lookup file, and the store checks it whole."""
    root = settings.root
    shard = write_groups(root, [make_group(i, "side", seed=i) for i in range(3)])
    kept = write_groups(root, [make_group(10, "side", seed=10)])
    table = pq.read_table(shard)
    logprobs = table.column("token_logprobs").to_pylist()
    logprobs[5][0] = float("nan")
    index = table.schema.get_field_index("token_logprobs")
    pq.write_table(table.set_column(index, "token_logprobs", pa.array(logprobs, table.schema.field(index).type)), shard)
    assert lookup_path(shard).exists()
    index = StoreIndex(settings).open()
    try:
        assert not shard.exists() and kept.exists() and index.queries.stats().total_groups == 1
        reasons = [p.read_text() for p in (root / "quarantine").glob("*.reason.txt")]
        assert len(reasons) == 1 and "token_logprobs" in reasons[0], reasons
    finally:
        index.close()


def test_json_answers_keep_their_schema_after_a_bad_shard_lands(tmp_path):
    root = tmp_path / "store"
    write_groups(root, [make_group(0, "side", seed=0)])
    with StoreServer(root) as srv:
        rows = groups_to_table([make_group(1, "side", seed=1)]).to_pylist()
        rows[0] = {**rows[0], "reward": float("nan"), "correct": False}
        pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA),
                       root / "rollouts" / "model=side" / "part-99990101T000000Z-nan.parquet")
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/v1/stats").json()["quarantined_files"] != 1:
            assert time.monotonic() < deadline, "the bad shard was not quarantined"
            time.sleep(0.05)
        page = httpx.get(f"{srv.url}/v1/rollouts", params={"limit": 100}).json()
        assert len(page["rollouts"]) == 4 and all(r["reward"] is not None for r in page["rollouts"])
        stats = httpx.get(f"{srv.url}/v1/stats").json()
        assert stats["models"][0]["success_rate"] == pytest.approx(0.5)


def test_a_problem_file_from_the_folder_is_checked_like_a_pushed_problem(settings):
    root = settings.root
    folder = root / "prompts" / "dataset=toy-math"
    folder.mkdir(parents=True)
    good = make_problem(1).model_dump()
    pq.write_table(pa.Table.from_pylist([good, {**good, "prompt_id": "0" * 16}]), folder / "part-bad.parquet")
    pq.write_table(pa.Table.from_pylist([{**make_problem(2).model_dump(), "dataset": "other"}]),
                   folder / "part-elsewhere.parquet")
    index = StoreIndex(settings).open()
    try:
        reasons = sorted(p.read_text() for p in (root / "quarantine").glob("*.reason.txt"))
        assert len(reasons) == 2 and "prompt_id" in reasons[1] and "'other'" in reasons[0], reasons
    finally:
        index.close()


# ------------------------------------------------------------------ 6: unsafe folders; compaction never loops


def test_a_folder_the_api_would_refuse_is_quarantined_and_compaction_stays_quiet(settings, caplog):
    root = settings.root
    write_groups(root, [make_group(i, "peer", seed=i) for i in range(2)])
    table = groups_to_table([make_group(5, "peer", seed=5)])
    table = table.set_column(table.schema.get_field_index("model_id"), "model_id", pa.array(["peer a"] * table.num_rows))
    unsafe = root / "rollouts" / "model=peer a"
    unsafe.mkdir(parents=True)
    pq.write_table(table, unsafe / "part-x.parquet")
    with caplog.at_level(logging.ERROR, logger="graft.store"):
        index = StoreIndex(settings).open()
        try:
            assert not unsafe.exists() and index.queries.stats().total_groups == 2
            reasons = [p.read_text() for p in (root / "quarantine").glob("*.reason.txt")]
            assert len(reasons) == 1 and "model=peer a" in reasons[0]
            assert any(p.is_dir() for p in (root / "quarantine").iterdir())  # the folder, whole
            for _ in range(3):
                index.compaction.compact(min_files=2)
        finally:
            index.close()
    assert "Traceback" not in caplog.text


def test_compaction_quarantines_an_unreadable_shard_instead_of_failing_every_round(settings, caplog):
    root = settings.root
    shards = [write_groups(root, [make_group(i, "peer", step=s, seed=i) for i in range(3)]) for s in range(3)]
    index = StoreIndex(settings).open()
    try:
        lookup_path(shards[1]).unlink()  # the lookup file gone and the shard damaged: its rows cannot be read
        shards[1].write_bytes(shards[1].read_bytes()[:200])
        index.catalog.reader.forget(shards[1].relative_to(root).as_posix())
        with caplog.at_level(logging.ERROR, logger="graft.store"):
            first = index.compaction.compact(min_files=2)  # never raises into the maintenance loop
            second = index.compaction.compact(min_files=2)
        assert not shards[1].exists() and index.queries.stats().quarantined_files == 1
        assert first["files_written"] + second["files_written"] == 1 and index.queries.stats().total_groups == 6
        assert caplog.text.count("quarantined") == 1
    finally:
        index.close()


# ------------------------------------------------------------------ 7: authenticate before reading the body


def test_an_unauthenticated_chunked_push_is_refused_without_reading_its_body(tmp_path):
    with StoreServer(tmp_path / "store", token="s3cret") as srv:
        rss_before = psutil.Process(srv.pid).memory_info().rss
        chunk = b"x" * (1 << 20)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/groups HTTP/1.1\r\nHost: store\r\nContent-Type: application/vnd.apache.arrow.stream"
                         b"\r\nTransfer-Encoding: chunked\r\n\r\n")
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            answer = sock.recv(4096)  # before the other 199 MB: the body is not read to answer
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
            sent = 1
            try:
                while sent < 200:
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    sent += 1
            except OSError:  # the server closed the connection or stopped reading: the rest is never read
                pass
        grown = (psutil.Process(srv.pid).memory_info().rss - rss_before) / 2**20
        assert grown < 64, f"server RSS grew by {grown:.0f} MB for a refused push ({sent} MB sent)"
        # with a Content-Length, the same: refused on its headers
        response = httpx.post(f"{srv.url}/v1/groups", content=b"x" * 2**20, headers={"content-type": ARROW})
        assert response.status_code == 401


def test_a_chunked_body_is_refused_when_it_passes_the_limit(server):
    def chunks():  # no Content-Length: counted as the route reads it
        for _ in range(40):
            yield b" " * 2**16

    for accept in ("application/json", ARROW):  # the route, and LookupFastPath before it
        response = httpx.post(f"{server.url}/v1/peer-groups/lookup", content=chunks(),
                              headers={"content-type": "application/json", "accept": accept})
        assert response.status_code == 413 and "exceeds the limit" in response.json()["error"], accept
    assert httpx.get(f"{server.url}/v1/health").json()["status"] == "ok"


# ------------------------------------------------------------------ 8-9: rollout ids and group ids


def test_rollout_ids_are_unique_in_a_push_and_against_the_store(server):
    first, second = make_group(20, "ids", seed=20), make_group(21, "ids", seed=21)
    assert push_json(server, [first]).status_code == 200
    borrowed = group_dict(second)
    for r, stored in zip(borrowed["rollouts"], first.rollouts):
        r["rollout_id"] = stored.rollout_id  # a new group reusing stored rollout ids
    response = push_json(server, [borrowed])
    assert response.status_code == 422 and "rollout_id" in response.json()["error"], response.text
    third = make_group(22, "ids", seed=22)
    both = [group_dict(third), group_dict(make_group(23, "ids", seed=23))]
    for r, other in zip(both[1]["rollouts"], both[0]["rollouts"]):
        r["rollout_id"] = other["rollout_id"]  # two groups of one push sharing rollout ids
    response = push_json(server, both)
    assert response.status_code == 422 and "rollout_id" in response.json()["error"], response.text
    table = groups_to_table([third, make_group(23, "ids", seed=23)])
    ids = table.column("rollout_id").to_pylist()
    ids[4:8] = ids[0:4]
    response = push_arrow(server, arrow_body(table.set_column(0, "rollout_id", pa.array(ids))))
    assert response.status_code == 422 and "rollout_id" in response.json()["error"], response.text


@pytest.mark.parametrize("group_id", ["a/b", "../x", "..", ".", "g" * 300, "with space", "-starts-with-dash", "ü"])
def test_a_group_id_the_api_cannot_serve_is_refused_on_push(server, group_id):
    group = make_group(30, "ids", seed=30, group_id="placeholder")
    body = group_dict(group, group_id=group_id)
    for i, r in enumerate(body["rollouts"]):
        r["rollout_id"] = f"{group_id}-{i}"
    response = push_json(server, [body])
    assert response.status_code == 422 and "group_id" in response.json()["error"], response.text
    table = groups_to_table([group])
    table = table.set_column(1, "group_id", pa.array([group_id] * table.num_rows))
    table = table.set_column(0, "rollout_id", pa.array([f"{group_id}-{i}" for i in range(table.num_rows)]))
    response = push_arrow(server, arrow_body(table))
    assert response.status_code == 422 and "group_id" in response.json()["error"], response.text


def test_every_group_id_a_push_accepts_can_be_fetched(server):
    for group_id in ("g:1.x-y_Z", "7" * 128):
        group = make_group(31, "ids", seed=31, group_id=group_id)
        assert push_json(server, [group]).status_code == 200
        fetched = httpx.get(f"{server.url}/v1/groups/{group_id}")
        assert fetched.status_code == 200 and RolloutGroup.model_validate(fetched.json()) == group
    assert httpx.get(f"{server.url}/v1/groups/{'7' * 129}").status_code == 422


# ------------------------------------------------------------------ 10: the smaller items


def test_a_rejected_push_leaves_no_prompts_folder(server):
    group = make_group(40, "smaller", seed=40)
    problems = [make_problem(40, dataset="good-name").model_dump(), {**make_problem(41).model_dump(), "dataset": "zz bad name"}]
    response = push_json(server, [group], problems)
    assert response.status_code == 422 and "dataset" in response.json()["error"], response.text
    assert not (server.root / "prompts" / "dataset=good-name").exists()
    assert not any((server.root / "rollouts").glob("model=smaller/*"))


def test_empty_peer_models_is_refused_and_bools_are_strict(server):
    url = f"{server.url}/v1/peer-groups/lookup"
    base = {"prompt_ids": ["0" * 16], "learner_model": "learner"}
    response = httpx.post(url, json={**base, "peer_models": []})
    assert response.status_code == 422 and "peer_models" in response.json()["error"]
    for value in (0.0, 1, "true", "no"):
        response = httpx.post(url, json={**base, "informative_only": value})
        assert response.status_code == 422 and "informative_only" in response.json()["error"], value
    assert httpx.post(url, json={**base, "informative_only": False}).status_code == 200
    group = group_dict(make_group(42, "smaller", seed=42))
    for r in group["rollouts"]:
        r["correct"] = int(r["correct"])
    assert push_json(server, [group]).status_code == 422


def test_a_group_id_stored_under_another_model_is_a_conflict_not_a_duplicate(server, settings):
    group = make_group(43, "first-model", seed=43, group_id="shared-id-43")
    assert push_json(server, [group]).json()["accepted_groups"] == 1
    again = push_json(server, [group])
    assert again.status_code == 200 and again.json()["duplicate_groups"] == ["shared-id-43"]  # a true duplicate
    other = make_group(43, "second-model", seed=44, group_id="shared-id-43")
    response = push_json(server, [other])
    assert response.status_code == 409 and "first-model" in response.json()["error"], response.text
    assert not (server.root / "rollouts" / "model=second-model").exists()
    # through the folder: skipped, counted apart from duplicates, and the file keeps only its other groups
    write_groups(settings.root, [group])
    write_groups(settings.root, [other, make_group(44, "second-model", seed=45)])
    index = StoreIndex(settings).open()
    try:
        stats = index.queries.stats()
        assert (stats.total_groups, stats.conflicting_groups, stats.duplicate_groups) == (2, 1, 0)
        live = pq.ParquetDataset(
            [settings.root / rel for rel in orjson.loads((settings.root / "manifest.json").read_bytes())["rollouts"]])
        assert sorted(set(live.read().column("model_id").to_pylist())) == ["first-model", "second-model"]
        assert live.read().num_rows == 8
    finally:
        index.close()


def test_created_at_may_not_lie_in_the_future(server):
    soon = datetime.now(timezone.utc) + timedelta(seconds=60)
    assert push_json(server, [make_group(45, "smaller", seed=45, created_at=soon)]).status_code == 200
    far = group_dict(make_group(46, "smaller", seed=46), created_at="9999-01-01T00:00:00Z")
    response = push_json(server, [far])
    assert response.status_code == 422 and "created_at" in response.json()["error"]
    table = groups_to_table([make_group(47, "smaller", seed=47)])
    index = table.schema.get_field_index("created_at")
    future = pa.array([datetime(9999, 1, 1, tzinfo=timezone.utc)] * table.num_rows, table.schema.field(index).type)
    response = push_arrow(server, arrow_body(table.set_column(index, "created_at", future)))
    assert response.status_code == 422 and "created_at" in response.json()["error"]


def test_top_p_is_refused_exactly_when_the_published_schema_refuses_it(server):
    published = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]["Rollout"]["properties"]["top_p"]
    low = published.get("minimum", published.get("exclusiveMinimum"))
    for top_p in (5e-324, 1e-46, 1.401298464324817e-45, 3e-45, 1e-30, 0.5):
        allowed = top_p >= low if "minimum" in published else top_p > low
        group = make_group(48, "top-p", seed=48)
        body = group_dict(group, top_p=top_p)
        response = push_json(server, [body])
        assert (response.status_code == 200) == allowed, (top_p, published, response.text)


def test_openapi_states_the_bearer_token_only_when_the_store_has_one(server, tmp_path):
    open_schema = httpx.get(f"{server.url}/openapi.json").json()
    assert "security" not in open_schema["paths"]["/v1/groups"]["post"]
    assert "securitySchemes" not in open_schema.get("components", {})
    assert "401" not in open_schema["paths"]["/v1/groups"]["post"]["responses"]
    with StoreServer(tmp_path / "closed", token="s3cret") as closed:
        schema = httpx.get(f"{closed.url}/openapi.json").json()
        assert schema["paths"]["/v1/groups"]["post"]["security"] == [{"HTTPBearer": []}]
        assert "401" in schema["paths"]["/v1/groups"]["post"]["responses"]


def test_405_says_which_methods_are_allowed(server):
    response = httpx.delete(f"{server.url}/v1/stats")
    assert response.status_code == 405 and response.headers["allow"] == "GET"
    response = httpx.get(f"{server.url}/v1/groups")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
