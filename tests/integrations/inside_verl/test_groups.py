"""What a verl step does with groups verl keeps that are not G full rows, and with the learner's own reward, on verl's
real classes (its replay buffer over TransferQueue, its balancing for 2 ranks, its reward loop and scorers, its own
advantage step): partial groups (some sessions failed), prompts whose sessions all failed, grafted rows scored by the
learner's reward (verl's gsm8k scorer; math_dapo under Dr. GRPO) or a stated mapping, and the actor's fields check."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import pytest

pytest.importorskip("verl.trainer", reason="verl runs in its own environment: make install-verl, then .venv-verl/bin/python -m pytest")

import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from transfer_queue import KVBatchMeta  # noqa: E402
from verl_world import GROUP, TOY_SOURCE, Planned, build_trainer, peer_group, step_to_the_actor  # noqa: E402

from graft.schemas import group_advantages  # noqa: E402
from graft.services.store_api.http.testing import StoreServer  # noqa: E402
from graft.services.store_api.local.shards import write_groups  # noqa: E402
from toy.task import completion_text  # noqa: E402

FIELDS = ["responses", "response_mask", "rm_scores", "advantages", "rollout_is_weights", "extra_info"]


@dataclass
class Step:
    trainer: object
    batch: KVBatchMeta  # the balanced batch
    meta: KVBatchMeta  # what _compute_advantage hands to _update_actor
    splice: object
    metrics: dict
    data: object  # FIELDS of the batch's rows, in its order

    def rows_of(self, prompt_id: str) -> list[int]:
        """The batch rows of a prompt, in session order."""
        found = [i for i, info in enumerate(self.data["extra_info"]) if info["prompt_id"] == prompt_id]
        return sorted(found, key=lambda i: int(self.batch.keys[i].rsplit("_", 2)[1]))

    def advantage(self, i: int) -> float:
        return float(self.data["advantages"][i][0])

    def reward(self, i: int) -> float:
        return float(self.data["rm_scores"][i].sum())


@contextmanager
def step(world, learner, reward_loop, tmp_path, plans: dict, groups: list, data_source: str = TOY_SOURCE,
         extra: tuple[str, ...] = ()):
    """One step of the trainer up to the actor on `plans` (the learner's rollouts) with `groups` in the store."""
    root = tmp_path / "store"
    write_groups(root, groups, world["problems"])
    with StoreServer(root) as server:
        trainer = build_trainer(world, server.url, learner, reward_loop, extra, plans)
        batch, meta, splice, metrics = step_to_the_actor(trainer, learner, world["problems"], data_source)
    try:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=FIELDS)
        yield Step(trainer, batch, meta, splice, metrics, data)
    finally:
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def success_last(world, problem):
    """The peer's group for `problem` whose one success is its last row (a cut to the first rows loses it)."""
    texts = [completion_text("0")] * (GROUP - 1) + [completion_text(problem.answer)]
    return peer_group(problem, texts, [0.0] * (GROUP - 1) + [1.0], world["peer_tok"], world["peer"])


def test_partial_groups_fill_the_slots_they_have_with_a_success_and_centred_advantages(world, learner, reward_loop,
                                                                                       tmp_path):
    """verl's sync trainer keeps a group some of whose sessions failed, with fewer rows (replay_buffer.py: missing
    trajectories are padded downstream). An all-fail group of n - 1 rows and one of 1 row, each given a peer group of
    n whose success is its last row: the rows picked are as many as the group has, the success among them, and their
    advantages are centred over the rows written (a group of one: 0), not over n rows of which some were cut."""
    mixed, short, lone = world["problems"]
    wrong = [completion_text(str(int(p.answer) + 1)) for p in world["problems"]]
    plans = {mixed.prompt_id: world["plans"][mixed.prompt_id],
             short.prompt_id: Planned(short, [wrong[1]] * (GROUP - 1), [0.0] * (GROUP - 1)),
             lone.prompt_id: Planned(lone, [wrong[2]], [0.0])}
    groups = [success_last(world, short), success_last(world, lone)]
    with step(world, learner, reward_loop, tmp_path, plans, groups) as s:
        # verl's balancing padded the 4 + 3 + 1 rows to its multiple (3 prompts x 4 = 12: 2 ranks, 1 mini-batch)
        assert len(s.batch) == 3 * GROUP and sum(bool(tag.get("is_padding")) for tag in s.batch.tags) == GROUP
        for problem, slots in ((short, GROUP - 1), (lone, 1)):
            rows = s.rows_of(problem.prompt_id)
            assert len(rows) == slots and all(s.batch.tags[i].get("graft") == "peer" for i in rows)
            rewards = [s.reward(i) for i in rows]
            assert 1.0 in rewards, rewards  # the kept success was not cut
            advantages = [s.advantage(i) for i in rows]
            assert sum(advantages) == pytest.approx(0.0, abs=1e-6), advantages
            assert advantages == pytest.approx(group_advantages(rewards, std_normalize=True), abs=1e-6)
        assert s.metrics["graft/frac_grafted"] == pytest.approx(2 / 3)
        assert s.metrics["graft/grafted_groups_subsampled"] == 2 and s.metrics["graft/peer_rollouts_unused"] == 1 + 3


def test_a_prompt_whose_sessions_all_failed_frees_its_lookup(world, learner, reward_loop, tmp_path):
    """A prompt whose sessions all failed leaves no trajectory: verl's replay buffer consumes it without rows. Its
    lookup is freed at that step with the others', not kept (and walked) for the rest of the run."""
    mixed, failed, gone = world["problems"]
    plans = {**world["plans"], gone.prompt_id: Planned(gone, [], [])}
    with step(world, learner, reward_loop, tmp_path, plans, [success_last(world, failed)]) as s:
        assert not any(info["prompt_id"] == gone.prompt_id for info in s.data["extra_info"])
        assert s.metrics["graft/frac_grafted"] == pytest.approx(1 / 2)
        assert s.trainer.graft_lookups == []


def test_grafted_rows_carry_the_learners_reward_verls_gsm8k_scorer(world, learner, reward_loop, tmp_path):
    """verl's gsm8k scorer is strict (`#### n`, else 0). A peer group stored by a `\\boxed{}` scorer: its boxed right
    answers (stored 1) score 0 under the learner's reward, its `#### n` answer (stored 0) scores 1; the grafted rows
    carry the learner's rewards, their advantages are computed from them, and the rows whose two verdicts differ are
    counted."""
    mixed, failed, _ = world["problems"]
    texts = [completion_text(failed.answer), f"#### {failed.answer}", completion_text(failed.answer),
             completion_text("0")]
    group = peer_group(failed, texts, [1.0, 0.0, 1.0, 0.0], world["peer_tok"], world["peer"])
    with step(world, learner, reward_loop, tmp_path, world["plans"], [group], data_source="openai/gsm8k") as s:
        rows = s.rows_of(failed.prompt_id)
        assert [s.reward(i) for i in rows] == [0.0, 1.0, 0.0, 0.0]
        expected = group_advantages([0.0, 1.0, 0.0, 0.0], std_normalize=True)
        assert [s.advantage(i) for i in rows] == pytest.approx(expected, abs=1e-6)
        assert s.metrics["graft/peer_rows_scored"] == GROUP and s.metrics["graft/peer_rows_verdict_changed"] == 3


def dapo_plans(world) -> dict:
    """The learner's rollouts scored by math_dapo (+1 right, -1 wrong)."""
    return {pid: Planned(plan.problem, plan.texts, [1.0 if r > 0 else -1.0 for r in plan.rewards])
            for pid, plan in world["plans"].items()}


@pytest.mark.parametrize("mapped", [False, True], ids=["math_dapo", "peer_reward_map"])
def test_under_dr_grpo_grafted_rows_take_the_learners_reward_scale(world, learner, reward_loop, tmp_path, mapped):
    """Dr. GRPO (norm_adv_by_std_in_grpo=false) keeps the rewards' scale in the advantages. math_dapo scores +-1; the
    peer stored 0/1: the grafted rows' advantages are those of the learner's +-1 (twice the stored rewards'), as verl's
    own are on the learner's rows, whether verl's math_dapo scorer scores the rows or graft.peer_reward_map states it
    (then the reward loop is not asked)."""
    mixed, failed, _ = world["problems"]
    extra = ("algorithm.norm_adv_by_std_in_grpo=false",) + (("+graft.peer_reward_map={0:-1,1:1}",) if mapped else ())
    group = next(g for g in world["groups"] if g.prompt_id == failed.prompt_id)  # stored 1, 0, 1, 0
    with step(world, learner, None if mapped else reward_loop, tmp_path, dapo_plans(world), [group],
              data_source="math_dapo", extra=extra) as s:
        rows = s.rows_of(failed.prompt_id)
        assert [s.reward(i) for i in rows] == [1.0, -1.0, 1.0, -1.0]
        assert [s.advantage(i) for i in rows] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-6)
        own = s.rows_of(mixed.prompt_id)  # verl's Dr. GRPO on the learner's +1, -1, -1, -1
        assert [s.advantage(i) for i in own] == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-6)
        assert s.metrics["graft/peer_rows_verdict_changed"] == 0


def test_the_actor_gets_no_grafted_batch_without_the_weights(world, learner, reward_loop, tmp_path):
    """At a step that grafted, `_update_actor` checks the record verl dispatches to its actor: one that does not list
    rollout_is_weights (or advantages, loss_mask, response_mask) raises before anything is dispatched; the record
    `_compute_advantage` returns passes."""
    failed = world["problems"][1]
    with step(world, learner, reward_loop, tmp_path, world["plans"], [success_last(world, failed)]) as s:
        group = s.trainer.actor_rollout_wg
        fields = [name for name in s.meta.fields if name != "rollout_is_weights"]
        stripped = KVBatchMeta(keys=s.meta.keys, tags=s.meta.tags, partition_id=s.meta.partition_id, fields=fields,
                               extra_info=dict(s.meta.extra_info))
        with pytest.raises(RuntimeError, match="rollout_is_weights"):
            s.trainer._update_actor(stripped, {})
        assert group.dispatched == []
        s.trainer._update_actor(s.meta, {})
        assert len(group.dispatched) == 1 and torch.is_tensor(s.data["rollout_is_weights"][0])
