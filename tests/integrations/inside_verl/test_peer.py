"""A verl run as a peer, on verl's real classes (its replay buffer over TransferQueue, its balancing, its reward loop):
it publishes its own groups with the rollout's logprobs (+graft.publish=true) before anything is written over them,
co-trains (+graft.peer_source=cotrain: waits for a co-trainer's group of a failed prompt), and posts the broker's wants
with their problems. Each test's store of its own on loopback."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("verl.trainer", reason="verl runs in its own environment: make install-verl, then .venv-verl/bin/python -m pytest")

import transfer_queue as tq  # noqa: E402
from verl_world import GROUP, build_trainer, step_to_the_actor  # noqa: E402

from graft.rollouts.hf_backend import teacher_forced_logprobs  # noqa: E402
from graft.rollouts.sampling import SamplingParams  # noqa: E402
from graft.schemas import mu_is_behaviour  # noqa: E402
from graft.services.store_api.http.client import StoreClient  # noqa: E402
from graft.services.store_api.http.testing import StoreServer  # noqa: E402
from graft.services.store_api.local.shards import write_groups  # noqa: E402


def stored_groups(url: str, model: str) -> dict[str, list[dict]]:
    """prompt id -> the rows `model` published of it."""
    with StoreClient(url) as client:
        rows = [row for page in client.iter_rollouts(model=model) for row in page.to_pylist()]
    found: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: r["rollout_id"]):
        found.setdefault(row["prompt_id"], []).append(row)
    return found


def test_a_verl_run_publishes_its_own_groups_with_the_rollouts_logprobs(world, learner, reward_loop, transfer_queue,
                                                                        tmp_path):
    """+graft.publish=true: each of the step's groups reaches the store as verl sampled it, the failed ones too (their
    own rows, not the peer rows the splice writes over them): the response tokens, rollout_log_probs as the rows'
    behaviour logprobs (the engine unnamed at temperature 1 without a cut: the model's own distribution, mu), the
    run's rewards, policy step 0 (verl's step 1 samples with the initial policy)."""
    write_groups(tmp_path / "store", world["groups"], world["problems"])  # the peer's groups of the two failed prompts
    with StoreServer(tmp_path / "store") as store:
        trainer = build_trainer(world, store.url, learner, reward_loop, ("+graft.publish=true",
                                                                         "+graft.model_id=verl-publisher"))
        batch, _, splice, _ = step_to_the_actor(trainer, learner, world["problems"])
        try:
            assert sum(d.grafts for d in splice.decisions) == 2  # both failed groups' rows were written over
            assert trainer.graft.peers.link.flush(60) and trainer.graft.peers.counters.groups_published == 3
            published = stored_groups(store.url, "verl-publisher")
        finally:
            trainer.graft.peers.close()
            tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    tokenizer = trainer.tokenizer
    assert set(published) == {p.prompt_id for p in world["problems"]}
    for problem in world["problems"]:
        plan, rows = world["plans"][problem.prompt_id], published[problem.prompt_id]
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": problem.problem}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False))
        assert [row["reward"] for row in rows] == plan.rewards and len(rows) == GROUP
        for row, text in zip(rows, plan.texts):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            assert row["completion_token_ids"] == ids and row["finish_reason"] == "stop" and row["policy_step"] == 0
            assert row["logprobs_mode"] == "raw" and mu_is_behaviour(row) and row["generator_id"].startswith("verl:")
            expected = teacher_forced_logprobs(learner, prompt, [ids], SamplingParams(n=1))[0]  # RecordedRollouts' mu
            assert row["token_logprobs"] == pytest.approx(expected, abs=1e-6)


def test_a_verl_run_co_trains_and_posts_its_wants(world, learner, reward_loop, transfer_queue, tmp_path):
    """+graft.peer_source=cotrain: the step publishes its groups, then waits for the co-trainer's group of each prompt it
    failed; one arrives during the wait and is grafted. The other never does: the wait ends at peers.wait_s, and with
    store_options.want_misses the prompt becomes a want carrying its problem (extra_info.problem) and gold answer
    (reward_model.ground_truth), so that a generator can sample and score it."""
    mixed, late, never = world["problems"]
    theirs = world["groups"][0]  # the co-trainer's group of `late`
    assert theirs.prompt_id == late.prompt_id
    empty_store = StoreServer(tmp_path / "store").start()
    trainer = build_trainer(world, empty_store.url, learner, reward_loop, (
        "+graft.peer_source=cotrain", "+graft.peer_options.wait_s=8", "+graft.peer_options.poll_s=0.1",
        "+graft.model_id=verl-cotrainer", "+graft.options.peer_models=[toy-peer]",
        "+graft.store_options.want_misses=true"))

    def co_trainer():  # publishes its group of `late` while the verl step waits for it
        with StoreClient(empty_store.url) as client:
            client.push_groups([theirs])

    timer = threading.Timer(2.0, co_trainer)
    timer.start()
    batch, _, splice, metrics = step_to_the_actor(trainer, learner, world["problems"])
    timer.join()
    try:
        assert trainer.graft.peers.link.flush(60)
        with StoreClient(empty_store.url) as client:
            wanted = {p.prompt_id: p for p in client.all_wanted() if "verl-cotrainer" in p.learners}
        published = stored_groups(empty_store.url, "verl-cotrainer")
    finally:
        trainer.graft.peers.close()
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        empty_store.stop()
    grafted = {d.prompt_id: d.peer_group.group_id for d in splice.decisions if d.grafts}
    assert grafted == {late.prompt_id: theirs.group_id}
    assert 2.0 <= metrics["graft/store_wait_s"] < 20  # it waited for the co-trainer, then for `never` till wait_s
    assert set(published) == {p.prompt_id for p in world["problems"]}  # a co-trainer publishes every group
    assert set(wanted) == {never.prompt_id}
    assert (wanted[never.prompt_id].problem, wanted[never.prompt_id].answer) == (never.problem, never.answer)
