"""The store as a broker (issues 50, 58): wanted prompts and the served ledger, over a real store server on loopback
(`graft-store serve` in a subprocess): recorded, listed for a generator a page at a time, leased to one generator at a
time, cleared only by a group the wanting learner's rule takes, indexed after the want (whatever the generator's clock
says), kept through a kill -9 and a restart and through short writes, bounded; the ledger's cap and orders in the
lookup, a retried post counted once; heartbeats; bad input refused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import orjson
import pytest
from store_factory import make_group, make_problem, wait_for

from graft.schemas import (
    HeartbeatRequest,
    LeaseRequest,
    PeerLookupRequest,
    ServedRequest,
    Want,
    WantedRequest,
    WantRule,
)
from graft.services.store_api.broker import Broker, Journal
from graft.services.store_api.broker import broker as broker_module
from graft.services.store_api.http.client import StoreClient, StoreError
from graft.services.store_api.http.testing import StoreServer


def want(i: int, reason: str = "nothing_stored", with_problem: bool = True) -> Want:
    problem = make_problem(i)
    return Want(prompt_id=problem.prompt_id, reason=reason, problem=problem if with_problem else None)


def wants(learner: str, step: int, *items: Want, rule: WantRule | None = None) -> WantedRequest:
    return WantedRequest(learner_model=learner, policy_step=step, wants=list(items), rule=rule)


def lease(generator: str, model: str = "peer", limit: int = 64, lease_s: float = 600.0) -> LeaseRequest:
    return LeaseRequest(model_id=model, generator_id=generator, limit=limit, lease_s=lease_s)


def backlog(client) -> set[str]:
    return {p.prompt_id for p in client.all_wanted()}


class NoGroups:
    """A store index with no groups (the broker's GroupSource), for brokers built without a server."""

    def prompt_refs(self, prompt_id): return []
    def select_group(self, group_id): return []
    def groups_after(self, seq): return [], 0
    def newest_seq(self): return 1


@pytest.fixture
def server(tmp_path):
    with StoreServer(tmp_path / "store", env={"GRAFT_STORE_MAX_WANTED": "6"}) as server:
        yield server


@pytest.fixture
def client(server):
    with StoreClient(server.url, retries=0) as client:
        yield client


def test_a_want_is_listed_for_other_models_and_cleared_by_their_informative_group(client):
    assert client.post_wanted(wants("learner", 3, want(1), want(2, "only_uninformative"))).backlog == 2
    assert client.post_wanted(wants("other-learner", 7, want(2, with_problem=False))).backlog == 2  # known now

    listed = client.wanted(model="peer", order="most_wanted")
    assert [p.prompt_id for p in listed.prompts] == [make_problem(2).prompt_id, make_problem(1).prompt_id]
    assert listed.prompts[0].learners == ["learner", "other-learner"]
    assert listed.prompts[0].problem == make_problem(2).problem and listed.prompts[0].answer == make_problem(2).answer
    assert [p.prompt_id for p in client.wanted(model="peer", order="oldest").prompts][0] == make_problem(1).prompt_id
    # the learner's own model is never asked to serve its own wants
    assert [p.learners for p in client.wanted(model="learner").prompts] == [["other-learner"]]

    # an all-fail group of a peer and an informative group of the learner itself clear nothing
    client.push_groups([make_group(1, model="peer", rewards=[0.0, 0.0, 0.0, 0.0])])
    client.push_groups([make_group(1, model="learner")])
    client.push_groups([make_group(3, model="peer")])  # a prompt nobody wants: another group must land after these
    wait_for(lambda: client.stats().total_groups == 3, what="three groups indexed")
    wait_for(lambda: client.stats().broker is not None, what="stats")
    assert client.stats().broker.backlog_wants == 3
    # an informative group of the peer for prompt 2 serves both learners
    client.push_groups([make_group(2, model="peer")])
    wait_for(lambda: client.stats().broker.backlog_prompts == 1, what="the wants of prompt 2 cleared")
    stats = client.stats().broker
    assert (stats.wants_recorded, stats.wants_cleared, stats.backlog_wants) == (3, 2, 1)
    assert stats.want_to_group_s_p50 is not None and stats.want_to_group_s_p50 >= 0
    assert [p.prompt_id for p in client.wanted(model="peer").prompts] == [make_problem(1).prompt_id]


def test_bad_wants_and_ledger_entries_are_refused_and_change_nothing(client, server):
    with pytest.raises(StoreError) as unknown:
        client.post_wanted(wants("learner", 0, want(1), want(5, with_problem=False)))
    assert unknown.value.status_code == 404 and make_problem(5).prompt_id in str(unknown.value)
    assert client.wanted().backlog == 0  # the good want of the same request was not recorded either

    body = {"learner_model": "l", "policy_step": 0,
            "wants": [{"prompt_id": make_problem(1).prompt_id, "problem": make_problem(2).model_dump()}]}
    answer = httpx.post(f"{server.url}/v1/wanted", json=body)
    assert answer.status_code == 422 and "prompt_id" in answer.json()["error"]
    body["wants"] = [{"prompt_id": make_problem(1).prompt_id, "reason": "bored", "problem": make_problem(1).model_dump()}]
    assert httpx.post(f"{server.url}/v1/wanted", json=body).status_code == 422

    group = make_group(1, model="peer")
    client.push_groups([group])
    with pytest.raises(StoreError) as never_had:
        client.record_served(ServedRequest(learner_model="l", policy_step=1, group_ids=[group.group_id, "no-such-group"]))
    assert never_had.value.status_code == 404 and "no-such-group" in str(never_had.value)
    assert client.times_served(group.group_id) == {}

    lookup = {"prompt_ids": [make_problem(1).prompt_id], "learner_model": "l", "max_times_served": 0}
    refused = httpx.post(f"{server.url}/v1/peer-groups/lookup", json=lookup)
    assert refused.status_code == 422 and "max_times_served" in refused.json()["error"]
    lookup |= {"max_times_served": 1, "order": "random"}
    assert httpx.post(f"{server.url}/v1/peer-groups/lookup", json=lookup).status_code == 422


def test_the_lookup_caps_and_orders_by_the_ledger(client):
    older = make_group(1, model="peer", step=1, rewards=[1.0, 1.0, 1.0, 0.0])
    newest = make_group(1, model="peer", step=2, rewards=[1.0, 0.0, 0.0, 0.0])
    client.push_groups([older, newest])
    prompt = make_problem(1).prompt_id

    def lookup(**policy):
        request = PeerLookupRequest(prompt_ids=[prompt], learner_model="l", groups_per_prompt=2, **policy)
        found = client.lookup_peer_groups(request)
        return [g.group_id for g in found.groups], found.miss_reasons

    assert lookup() == ([newest.group_id, older.group_id], {})
    assert lookup(order="most_successes") == ([older.group_id, newest.group_id], {})
    client.record_served(ServedRequest(learner_model="l", policy_step=5, group_ids=[newest.group_id]))
    client.record_served(ServedRequest(learner_model="other", policy_step=5, group_ids=[older.group_id] * 3))
    assert client.times_served(newest.group_id) == {"l": 1}
    assert client.times_served(older.group_id) == {"other": 3}
    assert lookup(order="least_served") == ([older.group_id, newest.group_id], {})
    assert lookup(max_times_served=1) == ([older.group_id], {})
    client.record_served(ServedRequest(learner_model="l", policy_step=6, group_ids=[older.group_id]))
    assert lookup(max_times_served=1) == ([], {prompt: "served_out"})
    assert lookup(max_times_served=2) == ([newest.group_id, older.group_id], {})
    # the ledger is the learner's: another learner's entries do not cap l's lookups, nor l's its
    request = PeerLookupRequest(prompt_ids=[prompt], learner_model="other", groups_per_prompt=2, max_times_served=3)
    assert [g.group_id for g in client.lookup_peer_groups(request).groups] == [newest.group_id]
    assert client.stats().broker.ledger_entries == 5


def test_wants_and_the_ledger_survive_a_kill_and_a_torn_journal(tmp_path):
    root = tmp_path / "store"
    with StoreServer(root) as server, StoreClient(server.url, retries=0) as client:
        group = make_group(4, model="peer")
        client.push_groups([group])
        client.post_wanted(wants("learner", 2, want(1), want(2)))
        client.record_served(ServedRequest(learner_model="learner", policy_step=2, group_ids=[group.group_id] * 2))
        server.kill()  # SIGKILL: no shutdown, nothing flushed but what was acknowledged
        journal = root / "broker" / "journal.jsonl"
        with open(journal, "ab") as f:
            f.write(b'{"k": "want", "learner": "learner", "prom')  # what a crash in the middle of an append leaves
        server.start()
        assert [p.prompt_id for p in client.wanted().prompts] == [make_problem(1).prompt_id, make_problem(2).prompt_id]
        assert client.times_served(group.group_id) == {"learner": 2}
        assert journal.read_bytes().endswith(b"\n")  # the torn record cut off, the journal rewritten whole
        stats = client.stats().broker
        assert (stats.backlog_wants, stats.ledger_entries, stats.wants_recorded) == (2, 2, 2)
        # a group that landed while the store was down clears its want at the restart
        server.stop()
        from graft.services.store_api.local import write_groups

        write_groups(root, [make_group(1, model="peer")])
        server.start()
        assert [p.prompt_id for p in client.wanted().prompts] == [make_problem(2).prompt_id]
        assert client.stats().broker.wants_cleared == 1
        served = client.stats().broker
    # `graft-store stats` with no server answering reads the root offline, the broker's journal included
    from typer.testing import CliRunner

    from graft.services.store_api.cli import app
    from graft.services.store_api.http.testing import free_port

    result = CliRunner().invoke(app, ["stats", "--root", str(root), "--port", str(free_port())])
    assert result.exit_code == 0, result.output
    offline = orjson.loads(result.output.strip().splitlines()[-1])["broker"]
    assert {k: offline[k] for k in ("backlog_wants", "wants_cleared", "ledger_entries")} == \
        {"backlog_wants": served.backlog_wants, "wants_cleared": 1, "ledger_entries": 2}


def test_the_backlog_is_bounded_least_recently_missed_first(client):
    client.post_wanted(wants("learner", 0, *[want(i) for i in range(5)]))
    client.post_wanted(wants("learner", 1, want(0, with_problem=False)))  # missed again: now the most recent
    client.post_wanted(wants("learner", 2, want(10), want(11)))
    listed = {p.prompt_id for p in client.wanted(limit=100).prompts}
    assert listed == {make_problem(i).prompt_id for i in (0, 2, 3, 4, 10, 11)}  # max_wanted 6: prompt 1 went
    stats = client.stats().broker
    assert (stats.backlog_wants, stats.wants_evicted, stats.wants_recorded) == (6, 1, 7)
    with pytest.raises(StoreError) as evicted:  # its problem went with it: a want for it must bring it again
        client.post_wanted(wants("learner", 3, want(1, with_problem=False)))
    assert evicted.value.status_code == 404


def test_a_damaged_journal_line_is_kept_aside_not_skipped(tmp_path, caplog):
    journal = Journal(tmp_path / "broker", tmp_path)
    journal.append([{"k": "step", "learner": "a", "step": 1}, {"k": "step", "learner": "a", "step": 2}])
    data = journal.path.read_bytes()
    journal.close()
    journal.path.write_bytes(data.replace(b'"step":1}', b'"step":1?', 1))
    assert Journal(tmp_path / "broker", tmp_path).read() == []
    aside = list((tmp_path / "broker").glob("journal.jsonl.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == data.replace(b'"step":1}', b'"step":1?', 1)
    assert "damaged" in caplog.text


def test_a_journal_grown_past_its_state_is_compacted(tmp_path):
    broker = Broker(Journal(tmp_path / "broker", tmp_path), max_wanted=10, within_steps=2).open(NoGroups())
    for step in range(12_000):
        broker.want(wants("learner", step, want(step % 3)))
    lines = broker.journal.path.read_bytes().splitlines()
    assert len(lines) < 12_000  # rewritten to the state along the way
    again = Broker(Journal(tmp_path / "broker", tmp_path), max_wanted=10, within_steps=2).open(NoGroups())
    assert again.stats() == broker.stats()
    assert [p.misses for p in again.wanted(None, "oldest", 10).prompts] == [4000, 4000, 4000]
    assert orjson.loads(lines[-1])["k"] in ("want", "step")


def test_a_want_is_cleared_only_by_a_group_the_wanting_learners_rule_takes(client):
    """The learner posts its rule with its wants (peer models, lag, behaviour logprobs): a group of another model, an old
    step, or without mu leaves the want open, as the learner would not graft it; a group it takes clears it."""
    rule = WantRule(peer_models=["good"], max_policy_lag=2, require_behaviour_logprobs=True)
    client.post_wanted(wants("learner", 10, want(1), want(2), rule=rule))
    client.push_groups([make_group(1, model="other", step=10)])  # not among its peer models
    client.push_groups([make_group(1, model="good", step=7)])  # step 7 < 10 - 2: too old for its lag
    client.push_groups([make_group(1, model="good", step=10, without_mu=True)])  # no mu, which it requires
    client.push_groups([make_group(3, model="good", step=10)])  # a prompt nobody wants: the last group to land
    wait_for(lambda: client.stats().total_groups == 4, what="four groups indexed")
    client.push_groups([make_group(2, model="good", step=9)])  # one it takes: prompt 2's want goes
    wait_for(lambda: backlog(client) == {make_problem(1).prompt_id}, what="prompt 2's want cleared, prompt 1's kept")
    assert client.stats().broker.wants_cleared == 1
    # a generator of a model the rule leaves out is not handed the learner's wants at all
    assert client.wanted(model="other").prompts == [] and client.lease_wanted(lease("g", model="other")).prompts == []
    client.push_groups([make_group(1, model="good", step=8)])
    wait_for(lambda: backlog(client) == set(), what="prompt 1's want cleared by a group the rule takes")


def test_a_want_is_cleared_by_what_the_store_indexed_after_it_whatever_the_generators_clock(client):
    """Which group came after a want is the store's own order of indexing, never a comparison of the generator's clock
    (the rows' created_at) with the store's: a generator an hour behind clears a want with its fresh group, one four
    minutes ahead (the rows' validation takes up to five) whose group was stored before the want does not."""
    ahead = datetime.now(UTC) + timedelta(minutes=4)
    client.push_groups([make_group(1, model="peer", created_at=ahead)])  # stored before the want
    wait_for(lambda: client.stats().total_groups == 1, what="the group indexed")
    client.post_wanted(wants("learner", 1, want(1), want(2)))
    client.push_groups([make_group(3, model="peer")])
    wait_for(lambda: client.stats().total_groups == 2, what="a group after the want indexed")
    assert backlog(client) == {make_problem(1).prompt_id, make_problem(2).prompt_id}
    behind = datetime.now(UTC) - timedelta(hours=1)
    client.push_groups([make_group(2, model="peer", created_at=behind)])  # stored after the want
    wait_for(lambda: backlog(client) == {make_problem(1).prompt_id}, what="prompt 2's want cleared")


def test_wanted_prompts_are_paged_and_a_page_costs_the_page(client, tmp_path, monkeypatch):
    """GET /v1/wanted gives a page and the cursor of the next; the pages together list every wanted prompt once, in
    order. On a broker holding 20,000 wants a page of 10 builds 10 listings, not the backlog's."""
    client.post_wanted(wants("learner", 0, *[want(i) for i in range(5)]))
    client.post_wanted(wants("other", 1, want(3, with_problem=False)))
    pages, cursor = [], None
    while True:
        page = client.wanted(limit=2, cursor=cursor)
        pages.append([p.prompt_id for p in page.prompts])
        cursor = page.next_cursor
        if cursor is None:
            break
    # oldest first (wants of one post are as old: then by prompt id), each once
    assert [p for page in pages for p in page] == sorted(make_problem(i).prompt_id for i in range(5))
    assert all(len(page) == 2 for page in pages[:2]) and page.backlog == 5
    most = [p.prompt_id for p in client.all_wanted(order="most_wanted")]
    assert most[0] == make_problem(3).prompt_id and sorted(most) == sorted(make_problem(i).prompt_id for i in range(5))
    with pytest.raises(StoreError) as bad:
        client.wanted(cursor="not-a-cursor")
    assert bad.value.status_code == 400

    broker = Broker(Journal(tmp_path / "big", tmp_path), max_wanted=100_000, within_steps=2).open(NoGroups())
    for begin in range(0, 20_000, 1000):
        broker.want(wants("learner", begin, *[want(i) for i in range(begin, begin + 1000)]))
    built = []

    class Counted(broker_module.WantedPrompt):
        def __init__(self, **fields):
            built.append(fields["prompt_id"])
            super().__init__(**fields)

    monkeypatch.setattr(broker_module, "WantedPrompt", Counted)
    page = broker.wanted("peer", "oldest", 10, broker.wanted("peer", "oldest", 10).next_cursor)
    assert [p.prompt_id for p in page.prompts] == sorted(make_problem(i).prompt_id for i in range(1000))[10:20]
    assert len(built) == 20  # two pages of 10: what they hold, not 2 x 20,000
    built.clear()
    assert len(broker.lease(lease("g", limit=5)).prompts) == 5 and len(built) == 5


def test_each_wanted_prompt_is_leased_to_one_generator_at_a_time(client):
    """Two generators asking for work at once get different prompts; a prompt is free again once a group of the
    lessee's model for it is in (here an all-fail one, which leaves the want open) or once its lease ran out."""
    client.post_wanted(wants("learner", 0, *[want(i) for i in range(4)]))
    first = [p.prompt_id for p in client.lease_wanted(lease("gen-a", limit=2)).prompts]
    second = [p.prompt_id for p in client.lease_wanted(lease("gen-b", limit=3)).prompts]
    assert len(first) == 2 and len(second) == 2 and not set(first) & set(second)  # all four taken, each once
    assert client.lease_wanted(lease("gen-c")).prompts == []
    assert len(client.wanted().prompts) == 4  # a listing is a read: it shows them all and leases nothing

    prompt = next(i for i in range(4) if make_problem(i).prompt_id == first[0])
    client.push_groups([make_group(prompt, model="peer", rewards=[0.0, 0.0, 0.0, 0.0])])  # gen-a's group: all-fail
    wait_for(lambda: [p.prompt_id for p in client.lease_wanted(lease("gen-c")).prompts] == [first[0]],
             what="the prompt free again once gen-a's group is in")
    # a generator of another model gets none either: a prompt is held whoever asks (gen-a's, gen-b's, gen-c's now)
    assert client.lease_wanted(lease("gen-d", model="peer-2")).prompts == []
    with pytest.raises(StoreError) as bad:
        client.lease_wanted(LeaseRequest.model_construct(model_id="peer", generator_id="g", limit=1, order="oldest",
                                                         lease_s=-1))
    assert bad.value.status_code == 422


def test_a_lease_runs_out_by_the_stores_clock(client):
    client.post_wanted(wants("learner", 0, want(1)))
    assert len(client.lease_wanted(lease("gen-a", lease_s=0.5)).prompts) == 1
    assert client.lease_wanted(lease("gen-b")).prompts == []
    wait_for(lambda: client.lease_wanted(lease("gen-b")).prompts, what="gen-a's lease to run out")


def test_a_ledger_post_sent_again_counts_once_and_heartbeats_are_kept(client):
    """A learner whose post's answer was lost sends it again: the step's entries count once (a later step's count
    again). Heartbeats: the count goes up with each, and a model that never beat is absent."""
    group = make_group(1, model="peer")
    client.push_groups([group])
    post = ServedRequest(learner_model="l", policy_step=3, group_ids=[group.group_id])
    client.record_served(post)
    client.record_served(post)
    assert client.times_served(group.group_id) == {"l": 1}
    client.record_served(post.model_copy(update={"policy_step": 4}))
    assert client.times_served(group.group_id) == {"l": 2}
    client.post_wanted(wants("l", 3, want(2)))
    client.post_wanted(wants("l", 3, want(2, with_problem=False)))
    assert client.wanted().prompts[0].misses == 1

    client.beat(HeartbeatRequest(model_id="learner", step=2, waiting=False))
    client.beat(HeartbeatRequest(model_id="learner", step=3, waiting=True))
    beats = client.heartbeats(["learner", "nobody"])
    assert set(beats) == {"learner"} and (beats["learner"].beats, beats["learner"].step, beats["learner"].waiting) == \
        (2, 3, True) and beats["learner"].age_s < 60


def test_the_journal_writes_a_record_whole_however_many_writes_it_takes(tmp_path, monkeypatch):
    """os.write may write less than it was given: the journal writes the rest (a record acknowledged is on disk whole)."""
    import os

    from graft.services.store_api.broker import journal as journal_module

    real_write = os.write
    monkeypatch.setattr(journal_module.os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    journal = Journal(tmp_path / "broker", tmp_path)
    records = [{"k": "step", "learner": "a" * 40, "step": step} for step in range(5)]
    journal.append(records)
    journal.close()
    monkeypatch.undo()
    assert Journal(tmp_path / "broker", tmp_path).read() == records


# ---------------------------------------------------------------------------------------------- on a lake

def test_two_replicas_of_a_lake_share_wants_and_the_ledger(pg_s3_lake, tmp_path):
    """Wants and ledger entries posted at one replica are seen at the other (the journal is a lake table); an
    informative group committed to the lake clears a want at both; a restarted replica reads them back."""
    from test_lake_replica import commit, replica

    from graft.services.store_api.lake.lake import Lake

    with Lake(pg_s3_lake) as lake:
        [group] = commit(lake, 7, 1, model="peer")
    with replica(tmp_path / "a", pg_s3_lake) as a, replica(tmp_path / "b", pg_s3_lake) as b, \
            StoreClient(a.url, retries=0) as at_a, StoreClient(b.url, retries=0) as at_b:
        at_a.post_wanted(wants("learner", 1, want(1), want(2)))
        wait_for(lambda: at_b.wanted().backlog == 2, what="b to follow a's wants")
        at_b.post_wanted(wants("learner-2", 4, want(2, with_problem=False)))  # b knows the problem from a's want
        wait_for(lambda: at_a.wanted(order="most_wanted").prompts[0].learners == ["learner", "learner-2"],
                 what="a to follow b's want")
        at_b.record_served(ServedRequest(learner_model="learner", policy_step=2, group_ids=[group, group]))
        wait_for(lambda: at_a.times_served(group) == {"learner": 2}, what="a to follow b's ledger entries")
        lookup = PeerLookupRequest(prompt_ids=[make_problem(7).prompt_id], learner_model="learner", max_times_served=2)
        assert at_a.lookup_peer_groups(lookup).miss_reasons == {make_problem(7).prompt_id: "served_out"}
        with pytest.raises(StoreError) as never_had:
            at_a.record_served(ServedRequest(learner_model="learner", policy_step=2, group_ids=["nope"]))
        assert never_had.value.status_code == 404

        with Lake(pg_s3_lake) as lake:  # a peer's informative group of prompt 1, committed to the lake
            commit(lake, 1, 1, model="peer")
        for client in (at_a, at_b):
            wait_for(lambda client=client: [p.prompt_id for p in client.wanted().prompts] == [make_problem(2).prompt_id],
                     what="the want of prompt 1 cleared")
        b.stop()
        b.start()
        assert [p.learners for p in at_b.wanted().prompts] == [["learner", "learner-2"]]
        assert at_b.times_served(group) == {"learner": 2}
        assert at_b.stats().broker.wants_cleared >= 1
