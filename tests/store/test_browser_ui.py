"""The trajectory browser in a real Chromium (Debian's, through chromedriver) against a live store on loopback,
filled with groups that tiny models sampled and math-verify scored; the store has a write token (reads stay open).

Every view is checked against the REST API: the overview's counts against /v1/stats, the GRAFT filter against
the peer lookup, the prompt page against the stored groups, the token colours against the stored logprobs. The
console must stay free of errors. Screenshots go to test-artifacts/browser/ (look at them).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from urllib.parse import urlencode

import httpx
import pytest
from browser_world import FACTORY, LEARNER, PEER, SECOND_PEER, build_browser_world
from store_factory import make_group, make_problem

from graft.schemas import prompt_id
from graft.services.store_api.http.testing import REPO_ROOT, StoreServer
from graft.services.store_api.local.shards import write_groups

SHOTS = REPO_ROOT / "test-artifacts" / "browser"
LOGPROB_FULL_COLOUR = math.log(1000)  # app.js: p <= 0.001 gets the full colour
LOW = (214, 39, 40)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_browser_world(tmp_path_factory.mktemp("browser"))


@pytest.fixture(scope="module")
def server(world):
    tokenizers = json.dumps([str(world.learner_dir), str(world.peer_dir)])
    with StoreServer(world.root, token="secret", env={"GRAFT_STORE_TOKENIZERS": tokenizers}) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        message = "Chromium is not installed: apt-get install -y chromium chromium-driver (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from demo.browser_shots import chromium, close

    driver = chromium()
    yield driver
    close(driver)


@pytest.fixture
def api(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def show(browser, server, path: str, shot: str | None = None) -> None:
    """Open a view, wait until it is drawn, save its screenshot, and check that the console stayed clean."""
    from demo.browser_shots import WIDTH, open_view, save_screenshot

    open_view(browser, server.url + path)
    if shot:
        save_screenshot(browser, SHOTS / f"{shot}.png")
        browser.set_window_size(WIDTH, 1000)
    assert_clean_console(browser)


def assert_clean_console(browser, allowed: tuple[str, ...] = ()) -> None:
    """No console error or warning, but for the failed requests named in `allowed` (a 404 logs one)."""
    problems = [e["message"] for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")
                and not any(a in e["message"] for a in allowed)]
    assert not problems, problems


def text(browser, css: str) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, css).text


def all_of(browser, css: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def every_rollout(api, **filters) -> list[dict]:
    rows, cursor = [], None
    while True:
        page = api.get("/v1/rollouts", params={**filters, "limit": 1000, **({"cursor": cursor} if cursor else {})}).json()
        rows += page["rollouts"]
        cursor = page["next_cursor"]
        if cursor is None:
            return rows


def percent(shown: str) -> float:
    return float(shown.rstrip("%"))


# ---------------------------------------------------------------------------------------------- overview


def test_overview_counts_equal_the_stats(browser, server, api):
    stats = api.get("/v1/stats").json()
    show(browser, server, "/ui/", "overview")
    assert text(browser, '[data-total="groups"] b') == f"{stats['total_groups']:,}"
    assert text(browser, '[data-total="rollouts"] b') == f"{stats['total_rollouts']:,}"
    assert {row.get_attribute("data-model") for row in all_of(browser, "#models tbody tr")} == {
        m["model_id"] for m in stats["models"]} == {LEARNER, PEER, SECOND_PEER, FACTORY}
    for model in stats["models"]:
        row = f'#models tr[data-model="{model["model_id"]}"]'
        for field in ("groups", "rollouts", "prompts", "max_policy_step"):
            assert text(browser, f'{row} [data-field="{field}"]') == f"{model[field]:,}"
        assert percent(text(browser, f'{row} [data-field="success_rate"]')) == pytest.approx(100 * model["success_rate"], abs=0.051)
        informative = 100 * model["informative_groups"] / model["groups"]
        assert percent(text(browser, f'{row} [data-field="informative_share"]')) == pytest.approx(informative, abs=0.051)
    # the plot: a line per model, a point per policy step with a success rate
    curves = api.get("/v1/stats/steps", params={"bins": 200}).json()
    for curve in curves["models"]:
        points = all_of(browser, f'#success-plot g[data-model="{curve["model_id"]}"] circle')
        assert len(points) == sum(p["success_rate"] is not None for p in curve["points"])


# ---------------------------------------------------------------------------------------------- prompt list


def listed_prompts(browser) -> list[str]:
    """Prompt ids of every page of the list on screen, following its "next page" links."""
    from demo.browser_shots import open_view

    found = []
    while True:  # read in one script: an auto-refresh may redraw the table meanwhile
        rows, following = browser.execute_script(
            "return [[...document.querySelectorAll('#prompt-table tr[data-prompt]')].map((r) => r.dataset.prompt),"
            " [...document.querySelectorAll('.pager a')].filter((a) => a.textContent.includes('next page'))"
            ".map((a) => a.href)[0] || null]")
        found += rows
        if following is None:
            return found
        open_view(browser, following)


def grafted_by_lookup(api, learner: str, peer: str | None) -> set[str]:
    """The prompts the peer lookup would graft for `learner`: its all-fail prompts that the lookup finds a group for."""
    outcomes: dict[str, list[bool]] = {}
    for row in every_rollout(api, model=learner):
        outcomes.setdefault(row["prompt_id"], []).append(row["correct"])
    all_fail = sorted(p for p, correct in outcomes.items() if not any(correct))
    body = {"prompt_ids": all_fail, "learner_model": learner, **({"peer_models": [peer]} if peer else {})}
    answer = api.post("/v1/peer-groups/lookup", json=body).json()
    return set(all_fail) - set(answer["misses"])


def test_failed_by_a_solved_by_b_lists_exactly_what_the_lookup_grafts(browser, server, api):
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from demo.browser_shots import open_view

    show(browser, server, "/ui/prompts")
    for name, model in (("failed_by", LEARNER), ("solved_by", PEER)):  # as a person would: the two menus
        Select(browser.find_element("css selector", f'select[name="{name}"]')).select_by_value(model)
        WebDriverWait(browser, 60).until(lambda b: f"{name}={model}" in b.execute_script(
            "return document.getElementById('view').dataset.ready || ''"))
    shared_link = browser.current_url
    assert f"failed_by={LEARNER}" in shared_link and f"solved_by={PEER}" in shared_link
    from demo.browser_shots import save_screenshot

    save_screenshot(browser, SHOTS / "prompts-graft.png")
    listed = listed_prompts(browser)
    expected = grafted_by_lookup(api, LEARNER, PEER)
    assert expected and sorted(listed) == sorted(expected) and len(set(listed)) == len(listed)
    open_view(browser, shared_link)  # the link alone shows the same list
    assert listed_prompts(browser) == listed
    # any peer: the store-factory peer's informative group grafts too, its all-correct one does not
    show(browser, server, f"/ui/prompts?failed_by={LEARNER}")
    any_peer = listed_prompts(browser)
    expected_any = grafted_by_lookup(api, LEARNER, None)
    assert sorted(any_peer) == sorted(expected_any)
    factory_prompts = {make_problem(i).prompt_id for i in (900, 901)}
    assert expected_any & factory_prompts == {make_problem(901).prompt_id}
    assert_clean_console(browser)


def test_search_dataset_and_correctness_filters(browser, server, api, world):
    show(browser, server, "/ui/prompts", "prompts")
    assert len(listed_prompts(browser)) == len(api.get("/v1/prompts", params={"limit": 200}).json()["prompts"])
    query = world.problems[3].problem  # "a+b=": "+" must travel encoded
    show(browser, server, f"/ui/prompts?{urlencode({'q': query})}")
    assert sorted(listed_prompts(browser)) == sorted(p.prompt_id for p in world.problems if query in p.problem)
    show(browser, server, f"/ui/prompts?outcome=all_fail&model={LEARNER}&dataset=toy_add")
    outcomes: dict[str, list[bool]] = {}
    for row in every_rollout(api, model=LEARNER, dataset="toy_add"):
        outcomes.setdefault(row["prompt_id"], []).append(row["correct"])
    assert sorted(listed_prompts(browser)) == sorted(p for p, correct in outcomes.items() if not any(correct))
    assert_clean_console(browser)


# ---------------------------------------------------------------------------------------------- prompt page


def test_the_prompt_page_shows_every_stored_group_newest_first(browser, server, api):
    from demo.browser_shots import open_view

    prompt = sorted(grafted_by_lookup(api, LEARNER, PEER))[0]
    rows = every_rollout(api, prompt_id=prompt)
    stored = {r["group_id"]: r for r in rows}
    show(browser, server, f"/ui/prompt/{prompt}", "prompt")
    shown = {card.get_attribute("data-group") for card in all_of(browser, "article.group")}
    assert shown == set(stored) and len(stored) >= 4
    for column in all_of(browser, "section.column"):
        model = column.get_attribute("data-model")
        groups = [card.get_attribute("data-group") for card in column.find_elements("css selector", "article.group")]
        assert {stored[g]["model_id"] for g in groups} == {model}
        steps = [stored[g]["policy_step"] for g in groups]
        assert steps == sorted(steps, reverse=True)  # newest first
    for row in rows:  # every rollout with its reward, advantage, answer, finish reason and length
        cells = [c.text for c in browser.find_elements("css selector", f'tr[data-rollout="{row["rollout_id"]}"] td')]
        assert cells[1] == f"{row['reward']:.2f}" and float(cells[2]) == pytest.approx(row["advantage"], abs=5e-4)
        assert cells[3] == (row["extracted_answer"] if row["extracted_answer"] is not None else "none")
        assert cells[4:6] == [row["finish_reason"], str(row["num_tokens"])]
    assert text(browser, "#gold") == api.get(f"/v1/prompts/{prompt}").json()["problems"][0]["answer"]
    # a page of one group per model; "show more" brings the next
    show(browser, server, f"/ui/prompt/{prompt}?n=1")
    assert len(all_of(browser, "article.group")) == len({r["model_id"] for r in rows})
    more = [a for a in all_of(browser, ".more a") if a.text == "show more"]
    assert more
    open_view(browser, more[0].get_attribute("href"))
    assert len(all_of(browser, "article.group")) > len({r["model_id"] for r in rows})
    assert_clean_console(browser)


def test_the_prompt_page_shows_how_often_each_group_was_served_and_the_overview_the_wants(browser, server, api):
    prompt = sorted(grafted_by_lookup(api, LEARNER, PEER))[0]
    served, never = list(dict.fromkeys(r["group_id"] for r in every_rollout(api, prompt_id=prompt)))[:2]
    token = {"Authorization": "Bearer secret"}
    for learner, times in (("learner-a", 2), ("learner-b", 1)):
        answer = api.post("/v1/served", json={"learner_model": learner, "policy_step": 3, "group_ids": [served] * times},
                          headers=token)
        assert answer.status_code == 200, answer.text
    show(browser, server, f"/ui/prompt/{prompt}")

    def note(group_id):
        return browser.execute_script(
            f"const n = document.querySelector('article.group[data-group=\"{group_id}\"] .served');"
            "return n && n.dataset.served ? [n.dataset.served, n.textContent, n.title] : null")

    deadline = time.monotonic() + 30
    while (note(served) is None or note(never) is None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert note(served) == ["3", "served 3×", "learner-a: 2, learner-b: 1"]
    assert note(never) == ["0", "never served", ""]

    problem = {"prompt_id": prompt_id("What is 1 + 1?"), "dataset": "wanted", "problem": "What is 1 + 1?", "answer": "2"}
    answer = api.post("/v1/wanted", headers=token, json={"learner_model": "learner-a", "policy_step": 3, "wants": [
        {"prompt_id": problem["prompt_id"], "reason": "nothing_stored", "problem": problem}]})
    assert answer.status_code == 200, answer.text
    broker = api.get("/v1/stats").json()["broker"]
    show(browser, server, "/ui/", "overview-broker")
    assert text(browser, '[data-broker="wanted now"] b') == f"{broker['backlog_prompts']:,}" != "0"
    assert text(browser, '[data-broker="ledger entries"] b') == f"{broker['ledger_entries']:,}"
    assert text(browser, '[data-broker="groups served"] b') == f"{broker['ledger_groups']:,}"


# ---------------------------------------------------------------------------------------------- rollout view


def expected_colour(logprob: float) -> tuple[int, int, int]:
    share = min(1.0, max(0.0, -logprob / LOGPROB_FULL_COLOUR))
    return tuple(math.floor(255 + (c - 255) * share + 0.5) for c in LOW)


def rgb(css: str) -> tuple[int, int, int]:
    return tuple(int(v) for v in re.findall(r"\d+", css)[:3])


def test_token_colours_follow_the_stored_logprobs(browser, server, api):
    from selenium.webdriver.common.action_chains import ActionChains

    prompt = sorted(grafted_by_lookup(api, LEARNER, PEER))[0]
    group = api.get(f"/v1/prompts/{prompt}/groups", params={"model": PEER, "limit": 1}).json()["groups"][0]
    position = max(range(len(group["rollouts"])), key=lambda i: group["rollouts"][i]["num_tokens"])
    rollout = group["rollouts"][position]
    show(browser, server, f"/ui/rollout/{rollout['group_id']}/{position}", "rollout")
    tokens = all_of(browser, "#tokens .tok")
    assert [int(t.get_attribute("data-id")) for t in tokens] == rollout["completion_token_ids"]
    logprobs = [float(t.get_attribute("data-logprob")) for t in tokens]
    assert logprobs == pytest.approx(rollout["token_logprobs"], abs=1e-6)
    colours = [rgb(t.value_of_css_property("background-color")) for t in tokens]
    for colour, logprob in zip(colours, rollout["token_logprobs"]):
        assert all(abs(a - b) <= 1 for a, b in zip(colour, expected_colour(logprob)))
    by_logprob = sorted(zip(rollout["token_logprobs"], colours))  # less likely: deeper colour (less green)
    assert [c[1] for _, c in by_logprob] == sorted((c[1] for _, c in by_logprob))
    # the tokens' text is the completion (the EOS token shown as itself)
    shown = "".join(t.get_attribute("textContent").replace("↵\n", "\n") for t in tokens)
    assert shown == rollout["completion_text"] + "<|endoftext|>"
    # hover the least likely token: its text, id and probability
    unlikely = min(range(len(tokens)), key=lambda i: rollout["token_logprobs"][i])
    ActionChains(browser).move_to_element(tokens[unlikely]).perform()
    tip = text(browser, "#tip")
    assert f"id {rollout['completion_token_ids'][unlikely]}" in tip
    assert f"p = {math.exp(rollout['token_logprobs'][unlikely]):.4f}" in tip
    assert_clean_console(browser)


def test_without_the_tokenizer_the_view_says_what_it_shows(browser, server, api):
    prompt = make_problem(901).prompt_id
    group = api.get(f"/v1/prompts/{prompt}/groups", params={"model": FACTORY}).json()["groups"][0]
    rollout = group["rollouts"][1]
    show(browser, server, f"/ui/rollout/{rollout['group_id']}/1", "rollout-no-tokenizer")
    assert "token text not shown" in text(browser, "#token-note")
    assert text(browser, "#completion") == rollout["completion_text"]
    assert [t.text for t in all_of(browser, "#tokens .tok")] == [str(i) for i in rollout["completion_token_ids"]]


def test_a_rollout_without_behaviour_logprobs_shows_its_tokens_without_probabilities(browser, server, api, world):
    """logprobs_mode 'none' (docs/algorithm.md section 11): the tokens uncoloured, a note saying why, no probability in the
    tooltip and no least-likely table; the console clean."""
    from selenium.webdriver.common.action_chains import ActionChains

    group = make_group(960, FACTORY, step=6, without_mu=True)
    write_groups(world.root, [group], [make_problem(960)])
    gid = group.group_id
    deadline = time.monotonic() + 60
    while api.get(f"/v1/groups/{gid}").status_code != 200:
        assert time.monotonic() < deadline, "the group was not indexed"
        time.sleep(0.1)
    rollout = group.rollouts[1]
    show(browser, server, f"/ui/rollout/{gid}/1", "rollout-no-mu")
    assert "No behaviour logprobs" in text(browser, "#no-mu-note")
    tokens = all_of(browser, "#tokens .tok")
    assert [int(t.get_attribute("data-id")) for t in tokens] == rollout.completion_token_ids
    assert all(t.get_attribute("data-logprob") is None for t in tokens)
    assert "Least likely tokens" not in browser.page_source
    ActionChains(browser).move_to_element(tokens[0]).perform()
    assert "no behaviour logprob" in text(browser, "#tip") and "p = " not in text(browser, "#tip")
    assert_clean_console(browser)


# ---------------------------------------------------------------------------------------------- errors, freshness


@pytest.mark.parametrize("path,words,request_made", [
    ("/ui/prompt/not-a-prompt", "“not-a-prompt” is not a prompt id", None),
    ("/ui/prompt/0123456789abcdef", "no prompt 0123456789abcdef in this store", "/v1/prompts/0123456789abcdef"),
    ("/ui/rollout/no-such-group/0", "no group 'no-such-group' in this store", "/v1/groups/no-such-group"),
    ("/ui/somewhere", "no view at /ui/somewhere", None),
])
def test_a_bad_id_shows_a_clear_message(browser, server, path, words, request_made):
    from demo.browser_shots import open_view

    open_view(browser, server.url + path)
    assert words in text(browser, ".error")
    assert_clean_console(browser, allowed=(f"{request_made} - Failed to load resource",) if request_made else ())
    if request_made == "/v1/prompts/0123456789abcdef":
        from demo.browser_shots import save_screenshot

        save_screenshot(browser, SHOTS / "error.png")


def test_a_rollout_number_past_the_group_is_refused(browser, server, api):
    group_id = every_rollout(api, model=PEER)[0]["group_id"]
    show(browser, server, f"/ui/rollout/{group_id}/99")
    assert "there is no #99" in text(browser, ".error")


def test_new_groups_appear_without_a_reload(browser, server, api, world):
    from selenium.webdriver.support.ui import WebDriverWait

    show(browser, server, "/ui/")
    before = api.get("/v1/stats").json()["total_groups"]
    write_groups(world.root, [make_group(950, FACTORY, step=6), make_group(951, FACTORY, step=6)],
                 [make_problem(950), make_problem(951)])
    WebDriverWait(browser, 90).until(lambda b: text(b, '[data-total="groups"] b') == f"{before + 2:,}")
    # the list on its first page too; and with auto-refresh off, the button
    show(browser, server, "/ui/prompts")
    browser.find_element("css selector", "#auto").click()
    write_groups(world.root, [make_group(952, FACTORY, step=7)], [make_problem(952)])
    WebDriverWait(browser, 90).until(lambda b: api.get("/v1/health").json()["groups"] == before + 3)
    assert listed_prompts(browser)[0] != make_problem(952).prompt_id
    browser.find_element("css selector", "#refresh").click()
    WebDriverWait(browser, 60).until(lambda b: listed_prompts(b)[0] == make_problem(952).prompt_id)
    browser.find_element("css selector", "#auto").click()
    assert_clean_console(browser)
