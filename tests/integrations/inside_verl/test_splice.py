"""GRAFT inside verl's sync trainer on verl's real classes: its config, its replay buffer over a real TransferQueue
(Ray on loopback, verl's 8 storage units), its balancing for 2 data-parallel ranks, its reward loop, its own advantage
step, its dispatch to the actor and its loss; the store served by uvicorn on loopback; toy models from toy/.

Three prompts of G = 4: one the learner solves sometimes (trained as verl has it), two it fails; the store holds a
peer group (another tokenizer) for each failed prompt, one of them with only 3 rollouts (a slot left empty)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.trainer", reason="verl runs in its own environment: make install-verl, then .venv-verl/bin/python -m pytest")

import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl_world import (  # noqa: E402
    DP,
    GROUP,
    PEER_SIZES,
    actor_worker_group,
    build_trainer,
    graft_overrides,
    peer_group,
    prompt_batch,
    step_to_the_actor,
)

from graft.schemas import RolloutGroup, group_advantages  # noqa: E402
from graft.services.store_api.http.testing import StoreServer  # noqa: E402
from graft.services.store_api.local.shards import write_groups  # noqa: E402
from graft.trainer.batch import FirstPass, grafted_group_rows, old_logprobs_and_weights  # noqa: E402
from graft.trainer.loss import LossBatch, LossConfig, graft_loss  # noqa: E402
from toy.task import completion_text  # noqa: E402


@pytest.fixture(scope="module")
def stepped(world, store, learner, transfer_queue, reward_loop):
    """One step of the trainer up to the loss: submit (the lookup starts), sample from verl's replay buffer, balance
    (the splice), pi_old, verl's advantages and GRAFT's weights."""
    trainer = build_trainer(world, store.url, learner, reward_loop)
    batch, meta, splice, metrics = step_to_the_actor(trainer, learner, world["problems"])
    fields = ["prompts", "responses", "response_mask", "loss_mask", "rm_scores", "rollout_log_probs", "advantages",
              "rollout_is_weights", "old_log_probs", "uid", "extra_info"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    yield {"trainer": trainer, "batch": batch, "meta": meta, "splice": splice, "metrics": metrics, "data": data}
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def rows_of(stepped, prompt_id: str) -> list[int]:
    data = stepped["data"]
    found = [i for i, info in enumerate(data["extra_info"]) if info["prompt_id"] == prompt_id]
    return sorted(found, key=lambda i: int(stepped["batch"].keys[i].rsplit("_", 2)[1]))


def test_all_fail_groups_take_the_peer_rows_with_graft_trains_weights(world, stepped):
    data, splice, trainer, metrics = stepped["data"], stepped["splice"], stepped["trainer"], stepped["metrics"]
    mixed, *failed = world["problems"]
    assert [d.kind for d in splice.decisions] == ["mixed", "all_fail", "all_fail"] or \
        sorted(d.kind for d in splice.decisions) == ["all_fail", "all_fail", "mixed"]
    assert sum(d.grafts for d in splice.decisions) == 2

    cfg, learner = trainer.graft.cfg, trainer.graft.learner
    responses, masks = data["responses"].unbind(), data["response_mask"].unbind()
    advantages, weights = data["advantages"].unbind(), data["rollout_is_weights"].unbind()
    old, behaviour = data["old_log_probs"].unbind(), data["rollout_log_probs"].unbind()
    loss_masks, scores = data["loss_mask"].unbind(), data["rm_scores"].unbind()
    for problem, group, size in zip(failed, world["groups"], PEER_SIZES):
        rows = rows_of(stepped, problem.prompt_id)
        prompt = data["prompts"][rows[0]].tolist()
        # graft-train's rows of the same peer group, and its weights on the same pi_old
        expected = grafted_group_rows(cfg, learner, group, 0, prompt, trainer.graft.peer_tokenizers, learner.stop_token_id,
                                      splice.counts)
        assert len(expected) == size
        filled = rows[:size]
        width = max(len(row.completion_ids) for row in expected)
        pi_old = torch.zeros((size, width))
        for k, i in enumerate(filled):
            pi_old[k, : len(old[i])] = old[i]
        old_logprobs_and_weights(cfg, learner, None, expected, FirstPass(expected, None, pi_old))
        for i, row, rollout in zip(filled, expected, group.rollouts):
            n = len(row.completion_ids)
            assert responses[i].tolist() == row.completion_ids  # the peer's text in the learner's tokens
            assert masks[i].tolist() == [1] * n and loss_masks[i].tolist() == [1] * n
            assert torch.allclose(behaviour[i], torch.tensor(row.behaviour_logprobs))  # mu~, projected
            assert float(scores[i].sum()) == rollout.reward
            assert torch.allclose(advantages[i], torch.full((n,), row.advantage), atol=1e-6)
            assert torch.allclose(weights[i], row.token_weight, atol=1e-6)  # c = w * b
            assert 0 < float(weights[i].max()) <= cfg.graft.is_cap and not torch.allclose(weights[i], torch.ones(n))
        for i in rows[size:]:  # an empty slot: one token, masked out, no weight
            assert len(responses[i]) == 1 and masks[i].tolist() == [0] and loss_masks[i].tolist() == [0]
            assert weights[i].tolist() == [0.0] and advantages[i].tolist() == [0.0]
            assert stepped["batch"].tags[i]["is_padding"] and stepped["batch"].tags[i]["response_len"] == 1
    assert len(rows_of(stepped, failed[1].prompt_id)[PEER_SIZES[1]:]) == 1

    # the learner's mixed group: verl's GRPO advantages (group_advantages' convention), c = 1
    rows = rows_of(stepped, mixed.prompt_id)
    expected = group_advantages(world["plans"][mixed.prompt_id].rewards, std_normalize=True)
    for i, value in zip(rows, expected):
        assert torch.allclose(advantages[i], torch.full_like(advantages[i], value), atol=1e-5)
        assert torch.equal(weights[i], torch.ones_like(weights[i]))

    assert metrics["graft/frac_all_fail"] == pytest.approx(2 / 3) and metrics["graft/frac_grafted"] == pytest.approx(2 / 3)
    assert metrics["graft/peer_hit_rate"] == 1 and metrics["graft/peer_rollouts_consumed"] == sum(PEER_SIZES)
    assert metrics["graft/projection_spans"] == sum(PEER_SIZES) and metrics["graft/store_lookup_failures"] == 0
    assert 0 < metrics["graft/compat_weight_mean"] <= 1 and metrics["graft/learner_reward_mean"] == pytest.approx(1 / 12)
    # the gate's tally is graft-train's (graft.trainer.peers.gate_tally), reasons included: both failed groups grafted
    assert metrics["graft/groups_no_peer"] == metrics["graft/groups_no_peer_nothing_stored"] == 0
    # every peer row scored by the learner's reward (verl's \boxed{} scorer here), which agrees with the stored one
    assert metrics["graft/peer_rows_scored"] == sum(PEER_SIZES) and metrics["graft/peer_rows_verdict_changed"] == 0


def test_verls_loss_on_the_spliced_batch_is_graft_trains_loss(stepped):
    """verl's ppo_loss (vanilla, token-mean, its dual clip) with c in rollout_is_weights, summed over micro-batches
    as verl's engine sums them (batch_num_tokens of the whole mini-batch), equals trainer/loss.py's graft_loss on
    the same rows within 1e-6; pi_theta is off pi_old so that the ratio clips both ways and the dual clip binds."""
    data, trainer = stepped["data"], stepped["trainer"]
    masks = data["response_mask"].unbind()
    B, T = len(masks), max(len(m) for m in masks)
    padded = data.select("old_log_probs", "advantages", "rollout_is_weights", "response_mask").to_padded_tensor()
    mask = padded["response_mask"].bool()
    old = padded["old_log_probs"].float()
    current = (old + 1.5 * torch.randn((B, T), generator=torch.Generator().manual_seed(0))) * mask
    is_grafted = torch.tensor([tag.get("graft") == "peer" for tag in stepped["batch"].tags])
    sequence_advantages = torch.tensor([float(a[0]) if len(a) else 0.0 for a in data["advantages"].unbind()])

    actor = omega_conf_to_dataclass(trainer.config.actor_rollout_ref.actor)
    mini = TensorDict({name: data[name] for name in ("prompts", "responses", "response_mask", "loss_mask",
                                                      "old_log_probs", "advantages", "rollout_is_weights")}, batch_size=B)
    mini["current"] = torch.nested.as_nested_tensor([current[r, : len(masks[r])] for r in range(B)], layout=torch.jagged)
    tu.assign_non_tensor(mini, use_dynamic_bsz=False, micro_batch_size_per_gpu=actor.ppo_micro_batch_size_per_gpu,
                         dp_size=1, batch_num_tokens=int(data["loss_mask"].values().sum()), global_batch_size=B)
    micro_batches, _ = prepare_micro_batches(mini)  # verl's engine's split of the mini-batch
    assert len(micro_batches) == 6
    verl_loss = torch.zeros(())
    for micro in micro_batches:
        prompt_lens = micro["prompts"].offsets().diff()
        log_probs = torch.nested.as_nested_tensor(  # the model's output layout: one value per sequence token
            [torch.cat([torch.zeros(int(p) - 1), c, torch.zeros(1)]) for p, c in zip(prompt_lens, micro["current"].unbind())],
            layout=torch.jagged)
        loss, _ = ppo_loss(actor, {"log_probs": log_probs}, micro)
        verl_loss = verl_loss + loss

    ours, metrics = graft_loss(LossBatch(
        logprobs=current, old_logprobs=old, advantages=sequence_advantages, mask=mask,
        token_weight=padded["rollout_is_weights"].float(), is_grafted=is_grafted,
    ), LossConfig.from_train(trainer.graft.cfg))
    assert metrics["clip_frac_onpolicy"] > 0 and metrics["clip_frac_grafted"] > 0 and metrics["tokens_grafted"] > 0
    assert abs(float(verl_loss) - float(ours)) <= 1e-6, (float(verl_loss), float(ours))
    print(f"\nverl ppo_loss (6 micro-batches) {float(verl_loss):.9f}  graft_loss {float(ours):.9f}  "
          f"|diff| {abs(float(verl_loss) - float(ours)):.2e}")


def test_without_a_store_the_trainer_is_verls_sync_trainer(world, learner, transfer_queue, reward_loop):
    """No graft.store_url: no lookup, no splice, verl's batch as it is."""
    trainer = build_trainer(world, None, learner, reward_loop)
    assert isinstance(trainer, PPOTrainerSync) and trainer.graft is None
    trainer._submit_batch_to_rollout(prompt_batch(world["problems"]))
    batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=3)
    assert trainer.graft_lookups == [] and trainer.graft_splice is None
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    assert all(int(m.sum()) == len(m) for m in data["response_mask"].unbind())
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def update_actor(batches: list[TensorDict], overrides: list[str], tmp_path, name: str) -> dict[str, torch.Tensor]:
    """One `train_mini_batch` of verl's actor on `batches` (one per data-parallel rank, gloo between the ranks) through
    the test-only CPU shim (cpu_actor.py, one process per rank: the shim must register verl's cpu platform before
    anything resolves it); each parameter's change."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    target = tmp_path / f"{name}.out.pt"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    runs = []
    for rank, batch in enumerate(batches):
        source = tmp_path / f"{name}.{rank}.in.pt"
        torch.save({"overrides": overrides, "batch": batch}, source)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[2]), str(here / "helpers")]), OMP_NUM_THREADS="1",
                   RANK=str(rank), WORLD_SIZE=str(len(batches)), MASTER_PORT=str(port))
        runs.append(subprocess.Popen([sys.executable, str(here / "helpers" / "cpu_actor.py"), str(source), str(target)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [run.communicate(timeout=600)[1] for run in runs]
    assert all(run.returncode == 0 for run in runs), "\n".join(error[-3000:] for error in errors)
    out = torch.load(target, weights_only=False)
    return {k: out["after"][k] - out["before"][k] for k in out["before"]}


ACTOR_OVERRIDES = ["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.optim.optimizer=SGD",
                   "actor_rollout_ref.actor.optim.lr=1.0", "actor_rollout_ref.actor.optim.weight_decay=0",
                   "actor_rollout_ref.actor.optim.clip_grad=1e9",
                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]


def test_verls_actor_trains_the_grafted_rows_by_their_weights_through_verls_dispatch(world, learner, stepped, tmp_path):
    """`_update_actor` hands verl's actor the record `_compute_advantage` returned; verl's dispatch splits it for the
    DP = 2 ranks, each rank's worker reads its chunk through verl's tqbridge (kv_batch_meta2batch_meta, then the fields
    the record lists) and verl's actor (TrainingWorker, FSDP2 over gloo, ppo_loss; SGD, one step, no clipping) trains,
    the learner's own rows' advantages zeroed: its update equals one rank's update on the whole batch, which moves the
    parameters by the grafted rows' weights c: not at all with their c zeroed, half as far with c halved."""
    from verl.utils.transferqueue_utils import _meta_to_realdata, batch_meta2kv_batch_meta, kv_batch_meta2batch_meta

    meta, trainer = stepped["meta"], stepped["trainer"]
    peer_keys = {key for key, tag in zip(meta.keys, meta.tags, strict=True) if tag.get("graft") == "peer"}
    assert "rollout_is_weights" in kv_batch_meta2batch_meta(meta).field_names
    overrides = graft_overrides(world["learner_dir"], None, None) + ACTOR_OVERRIDES

    def prepared(batch: TensorDict, keys: list[str], factor: float = 1.0) -> TensorDict:
        """The learner's own rows' advantages zeroed, the grafted rows' c scaled by `factor`."""
        grafted = [key in peer_keys for key in keys]
        out = batch.clone()
        out["advantages"] = torch.nested.as_nested_tensor(
            [a if g else torch.zeros_like(a) for a, g in zip(batch["advantages"].unbind(), grafted, strict=True)],
            layout=torch.jagged)
        out["rollout_is_weights"] = torch.nested.as_nested_tensor(
            [w * factor if g else w for w, g in zip(batch["rollout_is_weights"].unbind(), grafted, strict=True)],
            layout=torch.jagged)
        return out

    sharded = {}

    def train(chunks):  # the DP ranks' update, on the chunks verl's dispatch made
        assert [chunk.size for chunk in chunks] == [len(meta) // DP] * DP
        sharded.update(update_actor([prepared(_meta_to_realdata(chunk), batch_meta2kv_batch_meta(chunk).keys)
                                     for chunk in chunks], overrides, tmp_path, "dp2"))
        return {}

    trainer.actor_rollout_wg = actor_worker_group(learner, train)
    trainer._update_actor(meta, {})
    assert len(trainer.actor_rollout_wg.dispatched) == 1 and sharded
    whole = _meta_to_realdata(meta)  # the actor's batch, as one worker receives it (with _update_actor's settings)
    assert len(peer_keys) == sum(PEER_SIZES)
    full = update_actor([prepared(whole, meta.keys)], overrides, tmp_path, "full")
    none = update_actor([prepared(whole, meta.keys, 0.0)], overrides, tmp_path, "zeroed")
    half = update_actor([prepared(whole, meta.keys, 0.5)], overrides, tmp_path, "halved")
    largest = max(float(d.abs().max()) for d in full.values())
    off_half = max(float((half[k] - 0.5 * full[k]).abs().max()) for k in full)
    off_dp = max(float((sharded[k] - full[k]).abs().max()) for k in full)
    print(f"\nlargest parameter change: c {largest:.3e}, c zeroed "
          f"{max(float(d.abs().max()) for d in none.values()):.3e}, |c halved - half of c| {off_half:.3e}, "
          f"|DP {DP} - one rank| {off_dp:.3e}")
    assert largest > 1e-4
    assert all(float(d.abs().max()) == 0.0 for d in none.values())
    assert off_half <= 1e-3 * largest, (off_half, largest)
    assert off_dp <= 1e-3 * largest, (off_dp, largest)


def test_verls_rollout_health_metrics_cover_the_learners_own_rows(stepped):
    """verl's rollout-vs-actor metrics (training/rollout_*, from `_compute_old_log_prob`) and rollout_corr/* (from
    `_compute_advantage`) compare pi_old with the sampler's logprobs: over the learner's own rows only, since a grafted
    row's sampler is the peer (its mu~ rides in rollout_log_probs)."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from verl.utils.debug.metrics import calculate_debug_metrics

    metrics, batch = stepped["metrics"], stepped["batch"]
    own = [key for key, tag in zip(batch.keys, batch.tags) if not tag.get("graft")]
    assert len(own) == GROUP  # the mixed group
    rows = tq.kv_batch_get(keys=own, partition_id="train", select_fields=[
        "responses", "rollout_log_probs", "old_log_probs", "response_mask"]).to_padded_tensor()
    expected = calculate_debug_metrics(DataProto(batch=rows))
    assert expected["training/rollout_probs_diff_max"] < 1e-4  # the learner's own sampler is pi_old here
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-6), name
    _, _, corr = compute_rollout_correction_and_rejection_mask(
        old_log_prob=rows["old_log_probs"].float(), rollout_log_prob=rows["rollout_log_probs"].float(),
        response_mask=rows["response_mask"], rollout_is=None, rollout_is_threshold=2.0)
    corr_names = [name for name in metrics if name.startswith("rollout_corr/")]
    assert corr_names
    for name in corr_names:
        assert metrics[name] == pytest.approx(corr[name], abs=1e-6, nan_ok=True), name


def test_a_peer_group_larger_than_n_keeps_a_success_and_a_failure(world, learner, transfer_queue, reward_loop,
                                                                   tmp_path):
    """A peer group of 8 (graft-generate's default G) for a learner with rollout.n = 4, whose one success is its last
    row: the first n rows would all fail (advantages 0, grafted for nothing); the seeded pick keeps the success."""
    problems = world["problems"]
    failed = problems[1]
    texts = [completion_text("0")] * 7 + [completion_text(failed.answer)]
    group = peer_group(failed, texts, [0.0] * 7 + [1.0], world["peer_tok"], world["peer"])
    root = tmp_path / "store"
    write_groups(root, [group], problems)
    with StoreServer(root) as server:
        trainer = build_trainer(world, server.url, learner, reward_loop)
        batch, meta, splice, metrics = step_to_the_actor(trainer, learner, problems)
    rows = [row for key, row in splice.slots.items() if row is not None]
    assert len(rows) == GROUP and sorted(row.reward for row in rows) == [0.0, 0.0, 0.0, 1.0]
    assert metrics["graft/grafted_groups_subsampled"] == 1 and metrics["graft/grafted_groups_no_signal"] == 0
    assert metrics["graft/peer_rollouts_unused"] == 8 - GROUP
    assert max(row.advantage for row in rows) > 0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def test_group_normalized_weights_centre_each_grafted_group_on_its_own(world, store, learner, transfer_queue,
                                                                       reward_loop):
    """graft.group_normalized_weight centres each grafted group's advantages under its rows' w: per group,
    sum_k w_k A'_k = 0 (the spec's cancellation on shared tokens), not across the step's grafted groups."""
    trainer = build_trainer(world, store.url, learner, reward_loop, ("+graft.options.group_normalized_weight=true",))
    batch, _, splice, _ = step_to_the_actor(trainer, learner, world["problems"])
    groups: dict[int, list] = {}
    for row in splice.slots.values():
        if row is not None:
            groups.setdefault(row.group, []).append(row)
    assert len(groups) == 2
    for rows in groups.values():
        assert abs(sum(row.compat_weight * row.advantage for row in rows)) < 1e-9
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def test_multi_modal_prompts_are_refused_before_generation(world, store, learner, reward_loop):
    """A prompt batch with images stops before verl generates, saying why (a peer's group is text), and so does a
    trajectory whose fields carry multi-modal inputs (TensorDict hands them over wrapped: NonTensorData)."""
    from verl.utils import tensordict_utils as tu

    trainer = build_trainer(world, store.url, learner, reward_loop)
    batch = prompt_batch(world["problems"])
    tu.assign_non_tensor_stack(batch, "multi_modal_data", [{"images": ["img"]}] * len(world["problems"]))
    with pytest.raises(NotImplementedError, match="multi_modal_data"):
        trainer._submit_batch_to_rollout(batch)
    row = TensorDict({"prompts": torch.tensor([1, 2]), "position_ids": torch.arange(3)}, batch_size=[])
    row["multi_modal_inputs"] = tu.NonTensorData({"pixel_values": torch.zeros(1)})
    with pytest.raises(NotImplementedError, match="multi-modal"):
        trainer.graft_row_fields(row, {}, [1, 2], None, 0.0)


def test_peer_groups_without_mu_graft_with_c_one_and_are_counted(world, learner, transfer_queue, reward_loop, tmp_path):
    """The peer's groups stored without behaviour logprobs (logprobs_mode 'none', docs/algorithm.md section 11): verl's rows
    get c = peer_loss_scale (b = 1, w = 1) in rollout_is_weights, pi_old (not 0.0, which is log 1: a sampler sure of
    every token) as their sampler's logprobs in rollout_log_probs, so that any ratio verl forms against them is 1, and
    graft/peer_rollouts_without_mu counts them."""
    no_mu = {"logprobs_mode": "none", "token_logprobs": [], "logprob_sum": None}
    groups = [RolloutGroup(rollouts=[r.model_copy(update=no_mu) for r in g.rollouts]) for g in world["groups"]]
    root = tmp_path / "store"
    write_groups(root, groups, world["problems"])
    with StoreServer(root) as server:
        trainer = build_trainer(world, server.url, learner, reward_loop)
        batch, meta, splice, metrics = step_to_the_actor(trainer, learner, world["problems"])
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                           select_fields=["response_mask", "rollout_is_weights", "rollout_log_probs", "old_log_probs"])
    scale = trainer.graft.cfg.graft.peer_loss_scale
    grafted = [i for i, tag in enumerate(batch.tags) if tag.get("graft") == "peer"]
    assert len(grafted) == sum(PEER_SIZES)
    masks, weights = data["response_mask"].unbind(), data["rollout_is_weights"].unbind()
    behaviour, old = data["rollout_log_probs"].unbind(), data["old_log_probs"].unbind()
    for i in grafted:
        n = int(masks[i].sum())
        assert weights[i].tolist() == [scale] * n
        assert torch.equal(behaviour[i], old[i]) and bool((old[i] < 0).all())
    assert metrics["graft/peer_rollouts_without_mu"] == metrics["graft/peer_rollouts_consumed"] == sum(PEER_SIZES)
    assert metrics["graft/projection_none"] == sum(PEER_SIZES) and metrics["graft/compat_weight_mean"] == 1.0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
