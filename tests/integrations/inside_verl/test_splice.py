"""GRAFT inside verl's sync trainer on verl's real classes: its config, its replay buffer over a real TransferQueue
(Ray on loopback), its own advantage step and loss; the store served by uvicorn on loopback; toy models from toy/.

Three prompts of G = 4: one the learner solves sometimes (trained as verl has it), two it fails; the store holds a
peer group (another tokenizer) for each failed prompt, one of them with only 3 rollouts (a slot left empty)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.trainer", reason="verl runs in its own environment: make install-verl, then .venv-verl/bin/python -m pytest")

import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl_world import GROUP, Planned, RecordedRollouts, graft_overrides, prompt_batch, verl_config  # noqa: E402

from graft.integrations.verl.trainer import GraftPPOTrainer  # noqa: E402
from graft.rollouts.models import tokenizer_fingerprint  # noqa: E402
from graft.schemas import RolloutGroup, group_advantages  # noqa: E402
from graft.services.store_api.http.testing import StoreServer  # noqa: E402
from graft.services.store_api.local.shards import write_groups  # noqa: E402
from graft.trainer.batch import FirstPass, grafted_group_rows, old_logprobs_and_weights  # noqa: E402
from graft.trainer.loss import LossBatch, LossConfig, graft_loss  # noqa: E402
from toy.models import build_tiny_model, save_model  # noqa: E402
from toy.task import completion_text, sample_problems  # noqa: E402
from toy.world import build_group, cached_chat_model, peer_tokenizer  # noqa: E402

PEER_SIZES = (4, 3)  # the two failed prompts' peer groups: the second leaves one of the G slots empty


@pytest.fixture(scope="module")
def transfer_queue():
    """verl's TransferQueue as its CPU tests start it (one storage unit: this machine has 2 cores)."""
    import ray
    from omegaconf import OmegaConf

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The learner (a chat-templated toy Llama), a peer with its own BPE, the problems and the learner's plans."""
    root = tmp_path_factory.mktemp("verl")
    learner_dir = cached_chat_model()
    peer_tok = peer_tokenizer()
    peer = build_tiny_model(peer_tok, "qwen3", hidden=64, seed=3).eval()
    peer_dir = save_model(peer, peer_tok, root / "peer")
    problems = sample_problems(3, seed=11)
    wrong = [completion_text(str(int(p.answer) + 1)) for p in problems]
    plans = {
        problems[0].prompt_id: Planned(problems[0], [completion_text(problems[0].answer)] + [wrong[0]] * 3, [1.0, 0, 0, 0]),
        problems[1].prompt_id: Planned(problems[1], [wrong[1]] * GROUP, [0.0] * GROUP),
        problems[2].prompt_id: Planned(problems[2], [wrong[2], "7", wrong[2], "12"], [0.0] * GROUP),
    }
    groups = []
    for problem, size in zip(problems[1:], PEER_SIZES):
        texts = [completion_text(problem.answer) if k % 2 == 0 else completion_text("0") for k in range(size)]
        groups.append(build_group(problem, texts, [1.0 if k % 2 == 0 else 0.0 for k in range(size)], peer_tok, peer,
                                  model_id="toy-peer", tokenizer_id=tokenizer_fingerprint(peer_tok)))
    store_root = root / "store"
    write_groups(store_root, groups, problems)
    return {"learner_dir": learner_dir, "peer_dir": peer_dir, "problems": problems, "plans": plans,
            "groups": groups, "store_root": store_root}


@pytest.fixture(scope="module")
def store(world):
    with StoreServer(world["store_root"]) as server:
        yield server


@pytest.fixture(scope="module")
def learner(world):
    return AutoModelForCausalLM.from_pretrained(world["learner_dir"]).eval()


def build_trainer(world, store_url: str | None, learner) -> GraftPPOTrainer:
    """verl's trainer object as main_ppo builds it, up to the workers (they need a GPU): its real __init__, its own
    tokenizer (`_init_tokenizer`), GRAFT's part of `_setup`, and the generation stand-in as its agent loop manager."""
    config = verl_config(graft_overrides(world["learner_dir"], store_url, world["peer_dir"]))
    trainer = GraftPPOTrainer(config)
    trainer._init_tokenizer()
    if store_url is not None:
        trainer.graft = trainer.graft_setup()
    trainer.global_steps = 1
    trainer.agent_loop_manager = RecordedRollouts(learner, trainer.tokenizer, world["plans"])
    return trainer


class LearnerLogProbs:
    """verl's actor worker group in the tests (its `compute_log_prob(batch)`): the learner's forward pass at the rollout
    temperature (1), written to TransferQueue as verl's worker writes it: `log_probs` and `entropy` in the model's
    output layout (one value per sequence token, the response's shifted left by one), which verl's
    `_compute_old_log_prob` turns into `old_log_probs` (response_from_nested)."""

    def __init__(self, learner):
        self.learner = learner

    def compute_log_prob(self, batch):
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
        rows = []
        with torch.no_grad():
            for prompt, response in zip(data["prompts"].unbind(), data["responses"].unbind()):
                ids = torch.cat([prompt, response])[None]
                logits = self.learner(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                values = logits.log_softmax(-1).gather(1, response[:, None])[:, 0]
                rows.append(torch.cat([torch.zeros(len(prompt) - 1), values, torch.zeros(1)]))
        log_probs = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        entropy = torch.nested.as_nested_tensor([torch.zeros_like(r) for r in rows], layout=torch.jagged)
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                               fields=TensorDict({"log_probs": log_probs, "entropy": entropy}, batch_size=len(rows)))


def step_to_the_actor(trainer, learner, problems):
    """One step of `trainer` as verl's `_step_once` runs it, up to the actor's update: submit (the lookup starts),
    sample from verl's replay buffer, balance (the splice), verl's pi_old, verl's advantages and GRAFT's weights.
    Returns (the batch as sampled, the meta `_compute_advantage` hands to `_update_actor`, the splice, the metrics)."""
    trainer.actor_rollout_wg = LearnerLogProbs(learner)
    trainer._submit_batch_to_rollout(prompt_batch(problems))
    batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=len(problems))
    trainer.graft_splice = splice = trainer.graft_splice_batch(batch)
    metrics: dict = {}
    batch = trainer._compute_old_log_prob(batch, metrics)
    meta = trainer._compute_advantage(batch, metrics)
    return batch, meta, splice, metrics


@pytest.fixture(scope="module")
def stepped(world, store, learner, transfer_queue):
    """One step of the trainer up to the loss: submit (the lookup starts), sample from verl's replay buffer, splice,
    pi_old, verl's advantages and GRAFT's weights."""
    trainer = build_trainer(world, store.url, learner)
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
    assert len(micro_batches) == 3
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
    print(f"\nverl ppo_loss (3 micro-batches) {float(verl_loss):.9f}  graft_loss {float(ours):.9f}  "
          f"|diff| {abs(float(verl_loss) - float(ours)):.2e}")


def test_without_a_store_the_trainer_is_verls_sync_trainer(world, learner, transfer_queue):
    """No graft.store_url: no lookup, no splice, verl's batch as it is."""
    trainer = build_trainer(world, None, learner)
    assert isinstance(trainer, PPOTrainerSync) and trainer.graft is None
    trainer._submit_batch_to_rollout(prompt_batch(world["problems"]))
    batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=3)
    assert trainer.graft_lookups == [] and trainer.graft_splice is None
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    assert all(int(m.sum()) == len(m) for m in data["response_mask"].unbind())
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def update_actor(batch: TensorDict, overrides: list[str], tmp_path, name: str) -> dict[str, torch.Tensor]:
    """One `train_mini_batch` of verl's actor on `batch` through the test-only CPU shim (cpu_actor.py, its own process:
    the shim must register verl's cpu platform before anything resolves it); each parameter's change."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    source, target = tmp_path / f"{name}.in.pt", tmp_path / f"{name}.out.pt"
    torch.save({"overrides": overrides, "batch": batch}, source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[2]), str(here)]), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(here / "cpu_actor.py"), str(source), str(target)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = torch.load(target, weights_only=False)
    return {k: out["after"][k] - out["before"][k] for k in out["before"]}


def test_verls_actor_trains_the_grafted_rows_by_their_weights_through_verls_dispatch(world, stepped, tmp_path):
    """The meta `_compute_advantage` returns lists rollout_is_weights, so the batch verl's dispatch builds from it for
    the actor's worker (tqbridge: kv_batch_meta2batch_meta, then the fields it lists) carries c; verl's actor
    (TrainingWorker, FSDP2, ppo_loss; SGD, one step, no clipping) with the learner's own rows' advantages zeroed then
    moves the parameters by the grafted rows' weights: not at all with their c zeroed, half as far with c halved."""
    from verl.utils.transferqueue_utils import _meta_to_realdata, kv_batch_meta2batch_meta

    meta = stepped["meta"]
    assert "rollout_is_weights" in kv_batch_meta2batch_meta(meta).field_names
    batch = _meta_to_realdata(meta)  # the actor's batch, as verl's worker receives it
    grafted = [tag.get("graft") == "peer" for tag in meta.tags]
    assert sum(grafted) == sum(PEER_SIZES)
    batch["advantages"] = torch.nested.as_nested_tensor(
        [a if g else torch.zeros_like(a) for a, g in zip(batch["advantages"].unbind(), grafted)], layout=torch.jagged)
    weights = batch["rollout_is_weights"].unbind()

    def scaled(factor: float) -> TensorDict:
        out = batch.clone()
        out["rollout_is_weights"] = torch.nested.as_nested_tensor(
            [w * factor if g else w for w, g in zip(weights, grafted)], layout=torch.jagged)
        return out

    overrides = graft_overrides(world["learner_dir"], None, None) + [
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.optim.optimizer=SGD",
        "actor_rollout_ref.actor.optim.lr=1.0", "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.optim.clip_grad=1e9", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
    full = update_actor(batch, overrides, tmp_path, "full")
    none = update_actor(scaled(0.0), overrides, tmp_path, "zeroed")
    half = update_actor(scaled(0.5), overrides, tmp_path, "halved")
    largest = max(float(d.abs().max()) for d in full.values())
    off_half = max(float((half[k] - 0.5 * full[k]).abs().max()) for k in full)
    print(f"\nlargest parameter change: c {largest:.3e}, c zeroed "
          f"{max(float(d.abs().max()) for d in none.values()):.3e}, |c halved - half of c| {off_half:.3e}")
    assert largest > 1e-4
    assert all(float(d.abs().max()) == 0.0 for d in none.values())
    assert off_half <= 1e-3 * largest, (off_half, largest)


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


def test_a_peer_group_larger_than_n_keeps_a_success_and_a_failure(world, learner, transfer_queue, tmp_path):
    """A peer group of 8 (graft-generate's default G) for a learner with rollout.n = 4, whose one success is its last
    row: the first n rows would all fail (advantages 0, grafted for nothing); the seeded pick keeps the success."""
    problems = world["problems"]
    peer_tok = peer_tokenizer()
    peer = AutoModelForCausalLM.from_pretrained(world["peer_dir"]).eval()
    failed = problems[1]
    texts = [completion_text("0")] * 7 + [completion_text(failed.answer)]
    group = build_group(failed, texts, [0.0] * 7 + [1.0], peer_tok, peer, model_id="toy-peer",
                        tokenizer_id=tokenizer_fingerprint(peer_tok))
    root = tmp_path / "store"
    write_groups(root, [group], problems)
    with StoreServer(root) as server:
        trainer = build_trainer(world, server.url, learner)
        batch, meta, splice, metrics = step_to_the_actor(trainer, learner, problems)
    rows = [row for key, row in splice.slots.items() if row is not None]
    assert len(rows) == GROUP and sorted(row.reward for row in rows) == [0.0, 0.0, 0.0, 1.0]
    assert metrics["graft/grafted_groups_subsampled"] == 1 and metrics["graft/grafted_groups_no_signal"] == 0
    assert metrics["graft/peer_rollouts_unused"] == 8 - GROUP
    assert max(row.advantage for row in rows) > 0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def test_group_normalized_weights_centre_each_grafted_group_on_its_own(world, store, learner, transfer_queue):
    """graft.group_normalized_weight centres each grafted group's advantages under its rows' w: per group,
    sum_k w_k A'_k = 0 (the spec's cancellation on shared tokens), not across the step's grafted groups."""
    config = verl_config(graft_overrides(world["learner_dir"], store.url, world["peer_dir"])
                         + ["+graft.options.group_normalized_weight=true"])
    trainer = GraftPPOTrainer(config)
    trainer._init_tokenizer()
    trainer.graft = trainer.graft_setup()
    trainer.global_steps = 1
    trainer.agent_loop_manager = RecordedRollouts(learner, trainer.tokenizer, world["plans"])
    batch, _, splice, _ = step_to_the_actor(trainer, learner, world["problems"])
    groups: dict[int, list] = {}
    for row in splice.slots.values():
        if row is not None:
            groups.setdefault(row.group, []).append(row)
    assert len(groups) == 2
    for rows in groups.values():
        assert abs(sum(row.compat_weight * row.advantage for row in rows)) < 1e-9
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def test_a_late_store_waits_once_per_step_and_is_said(world, store, learner, caplog):
    """graft.lookup_wait_s (30 s by default) is one deadline per step, however many lookups the step spans; a step
    whose lookup is still out after it is counted, and a few such steps in a row are warned about."""
    import time
    from concurrent.futures import Future

    from graft.integrations.verl.config import DEFAULT_LOOKUP_WAIT_S, graft_section
    from graft.integrations.verl.trainer import LATE_WARN_STEPS, Lookup

    defaults = [o for o in graft_overrides(world["learner_dir"], store.url, None) if "lookup_wait_s" not in o]
    assert graft_section(verl_config(defaults)).lookup_wait_s == DEFAULT_LOOKUP_WAIT_S > 0
    trainer = build_trainer(world, store.url, learner)
    trainer.graft_section.lookup_wait_s = 0.3
    for step in range(LATE_WARN_STEPS):
        ids = [p.prompt_id for p in world["problems"]]
        trainer.graft_lookups = [Lookup({"a": ids[0]}, Future()), Lookup({"b": ids[1]}, Future())]  # never answered
        began = time.perf_counter()
        with caplog.at_level("WARNING", logger="graft.integrations.verl.trainer"):
            _, found, _ = trainer.graft_collect(["a", "b"])
        assert time.perf_counter() - began < 0.55 and not found.groups  # one 0.3 s wait, not one per lookup
    assert trainer.graft.peers.counters.lookups_late == 2 * LATE_WARN_STEPS
    assert trainer.graft_late_steps == LATE_WARN_STEPS
    assert any("too late to graft" in r.getMessage() for r in caplog.records)


def test_multi_modal_prompts_are_refused_before_generation(world, store, learner):
    """A prompt batch with images stops before verl generates, saying why (a peer's group is text), and so does a
    trajectory whose fields carry multi-modal inputs (TensorDict hands them over wrapped: NonTensorData)."""
    from verl.utils import tensordict_utils as tu

    trainer = build_trainer(world, store.url, learner)
    batch = prompt_batch(world["problems"])
    tu.assign_non_tensor_stack(batch, "multi_modal_data", [{"images": ["img"]}] * len(world["problems"]))
    with pytest.raises(NotImplementedError, match="multi_modal_data"):
        trainer._submit_batch_to_rollout(batch)
    row = TensorDict({"prompts": torch.tensor([1, 2]), "position_ids": torch.arange(3)}, batch_size=[])
    row["multi_modal_inputs"] = tu.NonTensorData({"pixel_values": torch.zeros(1)})
    with pytest.raises(NotImplementedError, match="multi-modal"):
        trainer.graft_row_fields(row, {}, [1, 2], None, 0.0)


def test_peer_groups_without_mu_graft_with_c_one_and_are_counted(world, learner, transfer_queue, tmp_path):
    """The peer's groups stored without behaviour logprobs (logprobs_mode 'none', GRAFT_SPEC section 11): verl's rows
    get c = peer_loss_scale (b = 1, w = 1) in rollout_is_weights, zeros in the rollout_log_probs field that nothing
    reads on grafted rows, and graft/peer_rollouts_without_mu counts them."""
    no_mu = {"logprobs_mode": "none", "token_logprobs": [], "logprob_sum": None}
    groups = [RolloutGroup(rollouts=[r.model_copy(update=no_mu) for r in g.rollouts]) for g in world["groups"]]
    root = tmp_path / "store"
    write_groups(root, groups, world["problems"])
    with StoreServer(root) as server:
        trainer = build_trainer(world, server.url, learner)
        batch, meta, splice, metrics = step_to_the_actor(trainer, learner, world["problems"])
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                           select_fields=["response_mask", "rollout_is_weights", "rollout_log_probs", "extra_info"])
    scale = trainer.graft.cfg.graft.peer_loss_scale
    grafted = [i for i, tag in enumerate(batch.tags) if tag.get("graft") == "peer"]
    assert len(grafted) == sum(PEER_SIZES)
    masks, weights = data["response_mask"].unbind(), data["rollout_is_weights"].unbind()
    behaviour = data["rollout_log_probs"].unbind()
    for i in grafted:
        n = int(masks[i].sum())
        assert weights[i].tolist() == [scale] * n and behaviour[i].tolist() == [0.0] * n
    assert metrics["graft/peer_rollouts_without_mu"] == metrics["graft/peer_rollouts_consumed"] == sum(PEER_SIZES)
    assert metrics["graft/projection_none"] == sum(PEER_SIZES) and metrics["graft/compat_weight_mean"] == 1.0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
