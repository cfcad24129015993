"""A TRL run as a peer (integrations/trl: graft_publish, the co-training sources, the broker's settings): real TRL 1.16,
real store servers on loopback, the toy pair the tests build once (tests/conftest.py: toy_world).

The co-training test runs docs/cross-framework.md's two commands as the page prints them: a TRL `GraftGRPOTrainer` run of
the toy learner and a graft-train run of the toy peer, at once, through one store."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed: pip install '.[trl]'")

from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl_run import make_args, make_trainer  # noqa: E402

from graft.rollouts.hf_backend import teacher_forced_logprobs  # noqa: E402
from graft.rollouts.sampling import SamplingParams  # noqa: E402
from graft.schemas import mu_is_behaviour  # noqa: E402
from graft.services.store_api.http.client import StoreClient  # noqa: E402
from graft.services.store_api.http.testing import StoreServer  # noqa: E402

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = REPO_ROOT / "docs" / "cross-framework.md"


def page_blocks() -> list[tuple[str, str]]:
    """docs/cross-framework.md's fenced blocks that this test runs: (language, code), in page order."""
    text = PAGE.read_text()
    return [(language, code) for marker, language, code in
            re.findall(r"(<!-- walk: [^\n]*-->)\n```(\w+)\n(.*?)```", text, flags=re.S)
            if "tests/integrations/test_trl_peer.py" in marker]


def stored_rows(url: str, model: str) -> list[dict]:
    with StoreClient(url) as client:
        return [row for page in client.iter_rollouts(model=model) for row in page.to_pylist()]


def graft_lines(trainer) -> list[dict]:
    return [line for line in trainer.state.log_history if "graft/frac_grafted" in line]


@pytest.fixture(scope="module")
def workspace(toy_world, tmp_path_factory) -> Path:
    """A folder laid out as the page's commands expect: runs/pair holds the toy pair, configs/ the checkout's."""
    folder = tmp_path_factory.mktemp("cross_framework")
    (folder / "runs").mkdir()
    (folder / "runs" / "pair").symlink_to(toy_world.learner_dir.parent)
    (folder / "configs").symlink_to(REPO_ROOT / "configs")
    return folder


def test_a_trl_run_and_a_graft_train_run_co_train_through_one_store(toy_world, workspace, monkeypatch):
    """docs/cross-framework.md, as printed: the TRL run of the toy learner and graft-train's run of the toy peer, each
    co-training (cotrain) through one store. Each grafts the other's groups (both hit rates above 0), and the groups
    each published carry mu: the TRL run's are the learner's own logprobs of its sampled tokens."""
    (_, setup), (language, script), (_, command) = page_blocks()
    assert language == "python" and "graft-train train" in command
    # the page builds the pair with setup_models' defaults: toy.world.build_toy_models' recipe, which toy_world is
    assert setup.splitlines()[0].split("#")[0].split() == ["python", "-m", "toy.setup_models", "runs/pair"]
    with StoreServer(workspace / "runs" / "pair-store") as store:
        port = str(store.port)
        graft_train = [str(Path(sys.executable).parent / "graft-train"), *shlex.split(command.replace("8600", port))[1:]]
        log = (workspace / "graft-train.log").open("wb")
        process = subprocess.Popen(graft_train, cwd=workspace, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
        try:
            monkeypatch.chdir(workspace)
            namespace: dict = {}
            exec(compile(script.replace("8600", port), str(PAGE), "exec"), namespace)  # the TRL run, in this process
            assert process.wait(timeout=900) == 0, (workspace / "graft-train.log").read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
            log.close()
        trl_rows, train_rows = stored_rows(store.url, "learner"), stored_rows(store.url, "peer")

    lines = graft_lines(namespace["trainer"])
    assert len(lines) == 3
    assert max(line["graft/peer_hit_rate"] for line in lines) > 0 and sum(line["graft/frac_grafted"] for line in lines) > 0
    metrics = [json.loads(line) for line in (workspace / "runs" / "pair-peer" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    assert max(m["peer_hit_rate"] for m in metrics) > 0 and sum(m["frac_grafted"] for m in metrics) > 0
    assert {m["grafted_groups"][0]["model_id"] for m in metrics if m["grafted_groups"]} == {"learner"}

    # what each published: every group it sampled (3 steps x 32 prompts x 8), with mu
    for rows in (trl_rows, train_rows):
        assert len(rows) == 3 * 32 * 8 and {row["policy_step"] for row in rows} == {0, 1, 2}
        assert all(row["logprobs_mode"] == "processed" and mu_is_behaviour(row) for row in rows)
        assert all(len(row["token_logprobs"]) == row["num_tokens"] > 0 for row in rows)
    assert namespace["trainer"].graft.peers.counters.groups_published == 3 * 32
    # the TRL run's rows of step 0: the learner's own logprobs of the tokens it sampled (its initial weights, under the
    # mixed precision TRL sampled with: accelerate wraps the model's forward in it, generation's too)
    model = AutoModelForCausalLM.from_pretrained(toy_world.learner_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(toy_world.learner_dir)
    problem_of = {p.prompt_id: p.problem for p in toy_world.learner_problems + toy_world.peer_problems}
    for row in [row for row in trl_rows if row["policy_step"] == 0][:16]:
        prompt = tokenizer(problem_of[row["prompt_id"]])["input_ids"]
        with namespace["trainer"].accelerator.autocast():
            expected = teacher_forced_logprobs(model, prompt, [row["completion_token_ids"]], SamplingParams(n=1))[0]
        assert row["token_logprobs"] == pytest.approx(expected, abs=1e-4)
        assert row["finish_reason"] == ("stop" if row["completion_token_ids"][-1] == tokenizer.eos_token_id else "length")


class StartTheStoreAfter(TrainerCallback):
    """Brings the store up once the run has trained `step` steps (it was down until then)."""

    def __init__(self, server: StoreServer, step: int):
        self.server, self.step = server, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.start()


def test_a_publishing_run_whose_store_is_down_trains_on_and_delivers_once_it_is_back(toy_world, tmp_path):
    """graft_publish on a plain TRL run (prefetch): the store is down for its first step (that step's groups wait in the
    outbox, the step trains as GRPO) and back from its second: every group of both steps lands, none twice."""
    problems = toy_world.peer_problems[:4]
    server = StoreServer(tmp_path / "store")  # not started: the store is down
    args = make_args(tmp_path / "trl", server.url, toy_world.peer_dir, graft_publish=True,
                     graft_store_options={"timeout_s": 5.0, "retries": 0, "backoff_initial_s": 0.2, "backoff_max_s": 0.5})
    trainer = make_trainer(toy_world.learner_dir, problems, args)
    trainer.add_callback(StartTheStoreAfter(server, step=1))
    try:
        trainer.train()
        rows = stored_rows(server.url, trainer.graft.learner.model_id)
    finally:
        server.stop()
    lines = graft_lines(trainer)
    assert len(lines) == 2 and lines[0]["graft/store_lookup_failures"] == 1  # step 0: no store (it trained on)
    assert trainer.graft.peers.counters.groups_published == 2 * 4  # in the background, later than the lines
    assert len(rows) == 2 * 4 * 8 and len({row["group_id"] for row in rows}) == 2 * 4
    assert {row["policy_step"] for row in rows} == {0, 1} and all(mu_is_behaviour(row) for row in rows)
