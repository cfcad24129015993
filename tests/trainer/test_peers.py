"""The trainer's link to the store (trainer/store_link.py) and its sources of peer groups (trainer/peers.py) against a
real store server: the outbox under a push in flight, co-training's wait while the store is down, a co-trainer that
publishes nothing, prefetch's lookup that comes late."""

from __future__ import annotations

import logging
import math
import random
import threading

import pytest

import graft.trainer.peers as peers_module
import graft.trainer.store_link as link_module
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer, free_port
from graft.trainer.config import CotrainPeers, GraftOptions, StoreConfig
from graft.trainer.peers import Cotrain, PeerSource
from graft.trainer.store_link import StoreLink
from toy.task import sample_problems

LEARNER = "learner"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with StoreServer(tmp_path_factory.mktemp("store")) as server:
        yield server


@pytest.fixture(scope="module")
def groups(char_tokenizer, char_model):
    """12 all-fail groups of the learner, one per problem."""
    from toy.world import build_group

    return [build_group(p, ["1", "2"], [0.0, 0.0], char_tokenizer, char_model, model_id=LEARNER, tokenizer_id="char")
            for p in sample_problems(12, seed=3)]


def cotrain(config: StoreConfig, graft: GraftOptions, **settings) -> Cotrain:
    return Cotrain(StoreLink(config, LEARNER), graft, config, LEARNER, CotrainPeers(source="cotrain", **settings))


class GatedClient(StoreClient):
    """The real client, whose first push waits until the test lets it go (the race needs a push in flight)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pushing, self.release = threading.Event(), threading.Event()

    def push_groups(self, groups, problems=None):
        self.pushing.set()
        assert self.release.wait(60), "the test never released the push"
        return super().push_groups(groups, problems)


def stored_ids(url: str, model: str) -> set[str]:
    with StoreClient(url) as client:
        return {gid for page in client.iter_rollouts(model=model) for gid in page.column("group_id").to_pylist()}


def test_groups_published_while_a_push_is_in_flight_are_neither_lost_nor_miscounted(store, groups, monkeypatch):
    """Outbox limit 8, 8 groups pushing, 4 published meanwhile: all 12 reach the store, 12 counted published."""
    monkeypatch.setattr(link_module, "OUTBOX_LIMIT", 8)
    model = "race"
    mine = [g.model_copy(update={"rollouts": [r.model_copy(update={"model_id": model}) for r in g.rollouts]}) for g in groups]
    peers = StoreLink(StoreConfig(url=store.url), model)
    gated = GatedClient(store.url)
    peers._publish_client = gated
    try:
        peers.publish(mine[:8], [None] * 8)
        assert gated.pushing.wait(60)
        peers.publish(mine[8:], [None] * 4)  # the outbox is full while the first 8 are on their way
        gated.release.set()
        assert peers.flush(timeout_s=60)
        assert stored_ids(store.url, model) == {g.group_id for g in mine}
        assert peers.counters.groups_published == 12 and peers.counters.groups_dropped_from_outbox == 0
    finally:
        gated.release.set()
        peers.close()


def rewards_of(groups) -> list[tuple[str, list[float | None]]]:
    """The learner's rewards of `groups`, as a step hands them to its source."""
    return [(g.prompt_id, [r.reward for r in g.rollouts]) for g in groups]


def relabel(group, model: str, **update):
    """`group` as `model`'s, under an id of its own, its rows changed by `update` (unvalidated: the store is the
    judge)."""
    gid = group.group_id if group.group_id.startswith(f"{model}-") else f"{model}-{group.group_id}"
    return group.model_copy(update={"rollouts": [r.model_copy(update={"model_id": model, "group_id": gid,
                                                                      "rollout_id": f"{gid}-{i}", **update})
                                                 for i, r in enumerate(group.rollouts)]})


def test_groups_the_store_refuses_are_named_counted_and_dropped_and_the_others_land(store, groups, caplog):
    """One push of 11 groups, two of which the store refuses: a group id it holds under another prompt (409) and a
    reward outside [0, 1] (422). The other 9 land, the two are named in the log, counted, and never sent again."""
    model = "refused"
    mine = [relabel(g, model) for g in groups]
    with StoreClient(store.url) as client:
        client.push_groups([mine[0]])
    clash = relabel(mine[0], model, prompt_id=mine[1].prompt_id)  # mine[0]'s id, another prompt
    bad = mine[2].model_copy(update={"rollouts": [mine[2].rollouts[0].model_copy(update={"reward": 2.0, "correct": True}),
                                                  *mine[2].rollouts[1:]]})
    link = StoreLink(StoreConfig(url=store.url, retries=0), model)
    caplog.set_level(logging.ERROR, logger="graft.trainer.peers")
    try:
        link.publish([clash, bad, *mine[3:]], [None] * 11)
        assert link.flush(timeout_s=60), f"{link.outbox_size} groups still wait: refused ones are retried forever"
        assert stored_ids(store.url, model) == {g.group_id for g in [mine[0], *mine[3:]]}
        assert (link.counters.groups_published, link.counters.groups_refused) == (9, 2)
        said = " ".join(r.getMessage() for r in caplog.records)
        assert f"refused group {clash.group_id}" in said and f"refused group {bad.group_id}" in said
        link.publish([mine[1]], [None])
        assert link.flush(timeout_s=60) and link.counters.groups_published == 10  # nothing refused waits or goes again
    finally:
        link.close()


def test_groups_published_while_the_store_is_down_are_delivered_when_it_is_back_before_the_end(tmp_path, groups):
    """The store is down while the run publishes, and comes back while the link still backs off from it: the end's
    flush waits the pause out and delivers every group, instead of giving up on a store it believes down."""
    model = "outage"
    server = StoreServer(tmp_path / "store")  # not started: the store is down
    link = StoreLink(StoreConfig(url=server.url, retries=0, timeout_s=2, backoff_initial_s=20), model)
    try:
        link.publish([relabel(g, model) for g in groups[:4]], [None] * 4)
        link._publishing.result(timeout=30)
        assert link.counters.publish_failures == 1 and link.outbox_size == 4 and not link.available
        with server:
            assert not link.available  # still backing off: the run ends now
            assert link.flush(timeout_s=60)
            assert stored_ids(server.url, model) == {relabel(g, model).group_id for g in groups[:4]}
    finally:
        link.close()


def test_cotraining_does_not_wait_while_the_store_is_down(groups):
    """A store known to be down cannot bring the co-trainer's groups: the step does not wait cotrain_wait_s for them."""
    config = StoreConfig(url=f"http://127.0.0.1:{free_port()}", retries=0, timeout_s=2, backoff_initial_s=30)
    peers = cotrain(config, GraftOptions(), wait_s=60)
    try:
        request = peers.request([g.prompt_id for g in groups[:4]], 0)
        found = peers.candidates(peers.start_lookup(request), request, rewards_of(groups[:4]), None, 0)
        assert not found.ok and found.groups == {}
        assert found.wait_s < peers.wait_s / 2, f"waited {found.wait_s:.1f} s for a store that is down"
        assert peers.counters.cotrain_waits_skipped == 1
        assert math.isnan(found.peer_silent_steps) or found.peer_silent_steps == 0  # no word either way
    finally:
        peers.close()


def test_a_silent_co_trainer_is_warned_about_and_counted(store, groups, caplog):
    """The store answers but the co-trainer publishes nothing: every step's wait runs out; the count of such steps
    is the step's metric, and a warning says so after PEER_SILENT_WARN_STEPS of them."""
    peers = cotrain(StoreConfig(url=store.url), GraftOptions(peer_models=["nobody"]), wait_s=0.3, poll_s=0.1)
    caplog.set_level(logging.WARNING, logger="graft.trainer.peers")
    try:
        silent = []
        for step in range(peers_module.PEER_SILENT_WARN_STEPS):
            request = peers.request([g.prompt_id for g in groups[:2]], step)
            found = peers.candidates(peers.start_lookup(request), request, rewards_of(groups[:2]), None, step)
            assert found.ok
            silent.append(found.peer_silent_steps)
        assert silent == list(range(1, peers_module.PEER_SILENT_WARN_STEPS + 1))
        warnings = [r.getMessage() for r in caplog.records if "co-trainer" in r.getMessage()]
        assert len(warnings) == 1 and f"{peers_module.PEER_SILENT_WARN_STEPS} steps" in warnings[0], warnings
        # The co-trainer speaks: its group of a prompt this step failed ends the count.
        theirs = groups[0].model_copy(update={"rollouts": [r.model_copy(update={"model_id": "nobody", "group_id": "n0",
                                                                                  "rollout_id": f"n0-{i}"})
                                                           for i, r in enumerate(groups[0].rollouts)]})
        with StoreClient(store.url) as client:
            client.push_groups([theirs])
        request = peers.request([g.prompt_id for g in groups[:2]], 99)
        found = peers.candidates(peers.start_lookup(request), request, rewards_of(groups[:2]), None, 99)
        assert found.peer_silent_steps == 0 and "n0" in {g.group_id for g in found.groups[groups[0].prompt_id]}
    finally:
        peers.close()


class HeldLookupClient(StoreClient):
    """The real client, whose lookups wait until the test lets them go (a store slower than the step's generation)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def lookup_peer_groups(self, request, validate=True):
        assert self.release.wait(60), "the test never released the lookup"
        return super().lookup_peer_groups(request, validate=validate)


@pytest.mark.parametrize("lookup_wait_s", [0.0, 30.0])
def test_offline_a_lookup_slower_than_generation_is_late_or_waited_for_as_lookup_wait_s_says(
        store, groups, char_tokenizer, char_model, lookup_wait_s):
    """Offline, the gate takes the background lookup's answer if it is back within store.lookup_wait_s: with 0 (the
    default) a lookup still out is counted late and the step has no peer group; with a wait it gets the group."""
    from toy.world import build_group

    problem = sample_problems(12, seed=3)[5]
    peer = f"slow-peer-{lookup_wait_s:g}"
    theirs = build_group(problem, ["1", "2"], [1.0, 0.0], char_tokenizer, char_model, model_id=peer, tokenizer_id="char")
    theirs = theirs.model_copy(update={"rollouts": [r.model_copy(update={"group_id": f"{peer}-g", "rollout_id": f"{peer}-g-{i}"})
                                                    for i, r in enumerate(theirs.rollouts)]})
    with StoreClient(store.url) as client:
        client.push_groups([theirs])
    config = StoreConfig(url=store.url)
    peers = PeerSource(StoreLink(config, LEARNER), GraftOptions(peer_models=[peer]), config, LEARNER,
                       lookup_wait_s=lookup_wait_s)
    held = HeldLookupClient(store.url)
    peers.link._lookup_client = held
    try:
        request = peers.request([groups[5].prompt_id], 0)
        pending = peers.start_lookup(request)
        if lookup_wait_s:
            threading.Timer(0.3, held.release.set).start()  # the store answers 0.3 s after generation ended
        found = peers.candidates(pending, request, rewards_of(groups[5:6]), None, 0)
        held.release.set()
        if lookup_wait_s:
            assert [g.group_id for g in found.groups[problem.prompt_id]] == [f"{peer}-g"]
            assert 0.25 <= found.wait_s < lookup_wait_s and peers.counters.lookups_late == 0  # it waited
        else:
            assert found.groups == {} and peers.counters.lookups_late == 1
            assert pending.result(timeout=60).ok  # it came back, after the gate had gone on
    finally:
        held.release.set()
        peers.close()


# ---- the broker's policies, as the trainer uses them ------------------------------------------------------------

def peer_group_of(problem, tokenizer, model, peer: str, step: int, rewards: list[float]):
    from toy.world import build_group

    group = build_group(problem, [str(i) for i in range(len(rewards))], rewards, tokenizer, model, model_id=peer,
                        tokenizer_id="char")
    gid = f"{peer}-{step}"
    return group.model_copy(update={"rollouts": [r.model_copy(update={"group_id": gid, "rollout_id": f"{gid}-{i}",
                                                                        "policy_step": step})
                                                 for i, r in enumerate(group.rollouts)]})


def test_a_late_store_waits_once_per_step_however_many_lookups_and_is_said(store, caplog):
    """The lookup wait (peers.lookup_wait_s; TRL's graft_lookup_wait_s and verl's graft.lookup_wait_s are it) is one
    deadline per step, however many lookups a host's step spans (verl's submissions); a step whose lookup is still out
    after it is counted late, and LATE_WARN_STEPS such steps in a row are warned about, in every trainer."""
    import time
    from concurrent.futures import Future

    config = StoreConfig(url=store.url)
    source = PeerSource(StoreLink(config, LEARNER), GraftOptions(), config, LEARNER, lookup_wait_s=0.3)
    caplog.set_level(logging.WARNING, logger="graft.trainer.peers")
    try:
        request = source.request([p.prompt_id for p in sample_problems(2, seed=5)], 0)
        for _ in range(peers_module.LATE_WARN_STEPS):
            began = time.monotonic()
            found = source.candidates([Future(), Future()], request, [], None, 0)  # never answered
            assert time.monotonic() - began < 0.55 and not found.groups  # one 0.3 s wait, not one per lookup
        assert source.counters.lookups_late == 2 * peers_module.LATE_WARN_STEPS
        assert source.late_steps == peers_module.LATE_WARN_STEPS
        assert sum("too late to graft" in r.getMessage() for r in caplog.records) == 1
    finally:
        source.close()


def test_the_gate_takes_the_stores_serving_order_least_served_rotates(store, groups, char_tokenizer, char_model):
    """store.serve_order least_served with three accepted peer groups of a prompt: the trainer posts what it grafts to
    the served ledger (before its next lookup asks), the store serves the least served first, and the gate takes that
    one: step after step the grafts rotate across the three, not the freshest again and again."""
    from graft.trainer.gate import gate_groups

    problem, learner, peer = sample_problems(12, seed=3)[0], "rotating-learner", "rotating-peer"
    theirs = [peer_group_of(problem, char_tokenizer, char_model, peer, step, [1.0, 0.0]) for step in (3, 2, 1)]
    with StoreClient(store.url) as client:
        client.push_groups(theirs)
    config = StoreConfig(url=store.url, serve_order="least_served", groups_per_prompt=4)
    source = PeerSource(StoreLink(config, learner), GraftOptions(peer_models=[peer]), config, learner, lookup_wait_s=30)
    rewards = [(problem.prompt_id, [0.0, 0.0])]
    grafted = []
    try:
        for step in range(4):
            request = source.request([problem.prompt_id], step)
            found = source.candidates(source.start_lookup(request), request, rewards_of(groups[:1]), None, step)
            decisions = gate_groups(rewards, found.groups, request, max_grafted_fraction=1.0, rng=random.Random(0))
            source.after_gate(step, decisions, found, {problem.prompt_id: problem}, rewards)
            grafted.append(decisions[0].peer_group.group_id)
        assert source.link.flush(60) and source.counters.served_posted == 4
    finally:
        source.close()
    assert grafted == [f"{peer}-3", f"{peer}-2", f"{peer}-1", f"{peer}-3"]  # freshest first, then the least served


def test_ledger_posts_that_fail_are_sent_again_and_refused_ones_are_dropped(tmp_path, groups, char_tokenizer, char_model):
    """The store is down when the step's served-ledger entry is posted: it is kept (counted as a failure) and sent once
    the store is back, and counted once; an entry the store refuses (a group it never had: 404) is logged, counted and
    dropped, never sent again."""
    from graft.services.store_api.local import write_groups
    from graft.trainer.config import TrainConfig

    problem = sample_problems(12, seed=3)[0]
    theirs = peer_group_of(problem, char_tokenizer, char_model, "ledger-peer", 1, [1.0, 0.0])
    write_groups(tmp_path / "store", [theirs])
    server = StoreServer(tmp_path / "store")  # not started: the store is down
    config = StoreConfig(url=server.url, retries=0, timeout_s=2, backoff_initial_s=0.05, backoff_max_s=0.1,
                         max_times_served=1)
    cfg = TrainConfig(model={"path": "m"}, data={"dataset": "d"}, store=config.model_dump())
    link = StoreLink(config, "ledger-learner")
    source = PeerSource(link, cfg.graft, config, "ledger-learner")
    try:
        link.post_broker(1, [], [theirs.group_id], source.want_rule())
        assert not link.flush(1) and link.broker_queued == 1 and link.counters.broker_failures >= 1
        with server:
            assert link.flush(60)
            with StoreClient(server.url) as client:
                assert client.times_served(theirs.group_id) == {"ledger-learner": 1}
            assert link.counters.served_posted == 1
            link.post_broker(2, [], ["never-stored"], source.want_rule())
            assert link.flush(60) and link.counters.broker_refused == 1 and link.broker_queued == 0
    finally:
        link.close()


def test_no_want_is_posted_for_a_prompt_no_generator_can_serve(store):
    """A prompt whose gold answer the scorer could not read (every reward None) is not wanted: a generator's group of it
    could not score either. The other miss is posted, with the learner's rule."""
    from graft.trainer.gate import GateDecision
    from graft.trainer.store_link import LookupResult

    problems = sample_problems(12, seed=4)[:2]
    learner = "want-learner"
    config = StoreConfig(url=store.url, want_misses=True)
    source = PeerSource(StoreLink(config, learner), GraftOptions(peer_models=["want-peer"]), config, learner)
    decisions = [GateDecision(p.prompt_id, "all_fail", "skip_no_peer") for p in problems]
    rewards = [(problems[0].prompt_id, [0.0, 0.0]), (problems[1].prompt_id, [None, None])]
    try:
        source.after_gate(0, decisions, LookupResult(ok=True), {p.prompt_id: p for p in problems}, rewards)
        assert source.link.flush(60) and source.counters.wants_posted == 1
    finally:
        source.close()
    with StoreClient(store.url) as client:
        listed = client.wanted(model="want-peer").prompts
        assert [p.prompt_id for p in listed if learner in p.learners] == [problems[0].prompt_id]
        assert client.wanted(model="not-a-peer").prompts == []  # its rule takes want-peer's groups only
