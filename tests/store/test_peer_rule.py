"""The rule of which peer group may be grafted is written once (`PeerLookupRequest.accepts`): the store's lookup
(a real index over real shards) and the trainer's gate agree with it, and so with each other, on a grid of
groups (who sampled them, at which step, how they scored, how old they are) and requests."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

import duckdb
import pytest
from pydantic import ValidationError
from store_factory import make_group, problem_text

from graft.schemas import PeerLookupRequest, prompt_id
from graft.schemas.api import now_us
from graft.services.store_api.local.index import StoreIndex
from graft.services.store_api.local.shards import write_groups
from graft.trainer.gate import GRAFT_ACTIONS, choose_peer_group

MODELS = ("learner", "peer-a", "peer-b")
STEPS = (0, 3, 5)  # 3: the requests' min_policy_step, so that the boundary is tested
# successes 0 to 4 of 4: the requests' min_successes (0, 1, 3) meet each at its boundary
OUTCOMES = {"all_fail": [0.0] * 4, "one": [1.0, 0.0, 0.0, 0.0], "mixed": [1.0, 0.0, 1.0, 0.0],
            "three": [1.0, 1.0, 1.0, 0.0], "all_success": [1.0] * 4}
AGES_H = (0, 2)
WITH_MU = (True, False)  # rows with behaviour logprobs, or without (logprobs_mode 'none')


def grid_groups():
    """One group per cell of the grid, each on a prompt of its own."""
    now = datetime.now(timezone.utc)
    cells = itertools.product(MODELS, STEPS, OUTCOMES, AGES_H, WITH_MU)
    return [make_group(i, model, step=step, rewards=OUTCOMES[outcome], created_at=now - timedelta(hours=age),
                       without_mu=not mu)
            for i, (model, step, outcome, age, mu) in enumerate(cells)]


def requests(prompt_ids):
    for peer_models, informative_only, min_successes, min_policy_step, max_age_s, require_mu in itertools.product(
        (None, ["peer-a"], ["peer-a", "peer-b"]), (True, False), (0, 1, 3), (None, 3), (None, 3600.0), (False, True)
    ):
        yield PeerLookupRequest(prompt_ids=prompt_ids, learner_model="learner", peer_models=peer_models,
                                informative_only=informative_only, min_successes=min_successes,
                                min_policy_step=min_policy_step, max_age_s=max_age_s,
                                require_behaviour_logprobs=require_mu)


def test_store_lookup_and_gate_apply_the_same_rule(settings):
    groups = grid_groups()
    for model in MODELS:  # a shard holds one model's groups
        write_groups(settings.root, [g for g in groups if g.model_id == model])
    ids = [prompt_id(problem_text(i)) for i in range(len(groups))]
    with_store = StoreIndex(settings).open()
    try:
        checked = 0
        for request in requests(ids):
            now = now_us()
            accepted = {g.group_id for g in groups if request.accepts_group(g, now)}
            refs, misses = with_store.queries.select_peer_groups(request)
            assert {ref.group_id for ref in refs} == accepted, request
            assert len(misses) == len(groups) - len(accepted)
            if request.min_successes == 1:  # what a trainer asks for: the gate grafts exactly what the store returns
                grafted = {g.group_id for g in groups if choose_peer_group([g], request, None, now)[1] in GRAFT_ACTIONS}
                assert grafted == accepted, request
            checked += 1
    finally:
        with_store.close()
    assert checked == 144


def test_the_rule_by_hand():
    groups = grid_groups()
    now = now_us()
    any_prompt = [prompt_id(problem_text(0))]
    accepted = [g for g in groups if PeerLookupRequest(prompt_ids=any_prompt, learner_model="learner").accepts_group(g, now)]
    # the defaults: informative groups (1, 2 or 3 successes of 4) of any other model, any step, any age, with mu or not
    assert len(accepted) == 2 * 3 * 3 * 2 * 2 and {g.model_id for g in accepted} == {"peer-a", "peer-b"}
    assert all(g.informative for g in accepted)
    require_mu = PeerLookupRequest(prompt_ids=any_prompt, learner_model="learner", require_behaviour_logprobs=True)
    with_mu = [g for g in accepted if g.has_behaviour_logprobs]
    assert [g for g in accepted if require_mu.accepts_group(g, now)] == with_mu
    assert len([g for g in accepted if g.has_behaviour_logprobs]) == 2 * 3 * 3 * 2
    union = PeerLookupRequest(prompt_ids=any_prompt, learner_model="learner", informative_only=False, min_policy_step=3,
                              max_age_s=3600.0, peer_models=["peer-b"])
    accepted = [g for g in groups if union.accepts_group(g, now)]
    # graft.union_all_success's request: groups of peer-b with a success, from step 3 on, made within the hour
    assert sorted(g.successes for g in accepted) == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert {g.policy_step for g in accepted} == {3, 5}
    with pytest.raises(ValidationError, match="peer_models"):  # an empty list of peers would admit none: refused
        PeerLookupRequest(prompt_ids=any_prompt, learner_model="learner", peer_models=[])


def test_the_sql_form_of_the_outcome_rule_agrees_with_python():
    """The store's SQL counts informative groups with the request's condition (stats, the browser): DuckDB and
    Python agree on every (successes, group size) and every outcome setting."""
    cells = [(successes, size) for size in (1, 2, 4, 8) for successes in range(size + 1)]
    table = duckdb.sql("SELECT * FROM (VALUES " + ", ".join(f"({s}, {g})" for s, g in cells) + ") t(successes, group_size)")
    for informative_only, min_successes in itertools.product((True, False), (0, 1, 3)):
        request = PeerLookupRequest(prompt_ids=[prompt_id(problem_text(0))], learner_model="learner", informative_only=informative_only,
                                    min_successes=min_successes)
        in_sql = set(table.filter(request.outcome_sql()).fetchall())
        assert in_sql == {cell for cell in cells if request.admits_outcome(*cell)}, request
    informative = set(table.filter(PeerLookupRequest.informative_sql()).fetchall())
    assert informative == {(s, g) for s, g in cells if 0 < s < g}


def test_store_stats_count_the_informative_groups_the_lookup_accepts(settings):
    groups = grid_groups()
    for model in MODELS:
        write_groups(settings.root, [g for g in groups if g.model_id == model])
    index = StoreIndex(settings).open()
    try:
        counted = {m.model_id: m.informative_groups for m in index.queries.stats().models}
    finally:
        index.close()
    assert counted == {model: sum(g.informative for g in groups if g.model_id == model) for model in MODELS} == {
        model: 3 * 3 * 2 * 2 for model in MODELS}
