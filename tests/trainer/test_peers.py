"""The trainer's link to the store (trainer/store_link.py) and its sources of peer groups (trainer/peers.py) against a
real store server: the outbox under a push in flight, co-training's wait while the store is down, a co-trainer that
publishes nothing, prefetch's lookup that comes late."""

from __future__ import annotations

import logging
import math
import threading

import pytest

import graft.trainer.peers as peers_module
import graft.trainer.store_link as link_module
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer, free_port
from graft.trainer.config import CotrainPeers, GraftConfig, StoreConfig
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


def cotrain(config: StoreConfig, graft: GraftConfig, **settings) -> Cotrain:
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


def test_cotraining_does_not_wait_while_the_store_is_down(groups):
    """A store known to be down cannot bring the co-trainer's groups: the step does not wait cotrain_wait_s for them."""
    config = StoreConfig(url=f"http://127.0.0.1:{free_port()}", retries=0, timeout_s=2, backoff_initial_s=30)
    peers = cotrain(config, GraftConfig(), wait_s=60)
    try:
        request = peers.request([g.prompt_id for g in groups[:4]], 0)
        found = peers.candidates(peers.start_lookup(request), request, groups[:4], None, 0)
        assert not found.ok and found.groups == {}
        assert found.wait_s < peers.wait_s / 2, f"waited {found.wait_s:.1f} s for a store that is down"
        assert peers.counters.cotrain_waits_skipped == 1
        assert math.isnan(found.peer_silent_steps) or found.peer_silent_steps == 0  # no word either way
    finally:
        peers.close()


def test_a_silent_co_trainer_is_warned_about_and_counted(store, groups, caplog):
    """The store answers but the co-trainer publishes nothing: every step's wait runs out; the count of such steps
    is the step's metric, and a warning says so after PEER_SILENT_WARN_STEPS of them."""
    peers = cotrain(StoreConfig(url=store.url), GraftConfig(peer_models=["nobody"]), wait_s=0.3, poll_s=0.1)
    caplog.set_level(logging.WARNING, logger="graft.trainer.peers")
    try:
        silent = []
        for step in range(peers_module.PEER_SILENT_WARN_STEPS):
            request = peers.request([g.prompt_id for g in groups[:2]], step)
            found = peers.candidates(peers.start_lookup(request), request, groups[:2], None, step)
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
        found = peers.candidates(peers.start_lookup(request), request, groups[:2], None, 99)
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
    peers = PeerSource(StoreLink(config, LEARNER), GraftConfig(peer_models=[peer]), config, LEARNER,
                       lookup_wait_s=lookup_wait_s)
    held = HeldLookupClient(store.url)
    peers.link._lookup_client = held
    try:
        request = peers.request([groups[5].prompt_id], 0)
        pending = peers.start_lookup(request)
        if lookup_wait_s:
            threading.Timer(0.3, held.release.set).start()  # the store answers 0.3 s after generation ended
        found = peers.candidates(pending, request, groups[5:6], None, 0)
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
