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
from graft.schemas import group_advantages  # noqa: E402
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


def write_old_logprobs(batch, learner) -> None:
    """pi_old of every row from the learner's forward pass at the rollout temperature (1), written back as verl's
    `_compute_old_log_prob` writes it (nested, one value per response token)."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
    rows = []
    with torch.no_grad():
        for prompt, response in zip(data["prompts"].unbind(), data["responses"].unbind()):
            ids = torch.cat([prompt, response])[None]
            logits = learner(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            rows.append(logits.log_softmax(-1).gather(1, response[:, None])[:, 0])
    old = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict({"old_log_probs": old}, batch_size=len(rows)))


@pytest.fixture(scope="module")
def stepped(world, store, learner, transfer_queue):
    """One step of the trainer up to the loss: submit (the lookup starts), sample from verl's replay buffer, splice,
    pi_old, verl's advantages and GRAFT's weights."""
    trainer = build_trainer(world, store.url, learner)
    trainer._submit_batch_to_rollout(prompt_batch(world["problems"]))
    batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=3)
    trainer.graft_splice = splice = trainer.graft_splice_batch(batch)
    write_old_logprobs(batch, learner)
    metrics: dict = {}
    trainer._compute_advantage(batch, metrics)
    fields = ["prompts", "responses", "response_mask", "loss_mask", "rm_scores", "rollout_log_probs", "advantages",
              "rollout_is_weights", "old_log_probs", "uid", "extra_info"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    yield {"trainer": trainer, "batch": batch, "splice": splice, "metrics": metrics, "data": data}
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
        expected = grafted_group_rows(cfg, learner, group, 0, prompt, trainer.graft.peer_tokenizers, trainer.graft.stop_token,
                                      splice)
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


def update_actor(batch: TensorDict, overrides: list[str], tmp_path, name: str) -> float:
    """One `train_mini_batch` of verl's actor on `batch` through the test-only CPU shim (cpu_actor.py, its own process:
    the shim must register verl's cpu platform before anything resolves it); the largest parameter change."""
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
    return max(float((out["after"][k] - out["before"][k]).abs().max()) for k in out["before"])


def test_verls_actor_update_moves_the_parameters_on_the_grafted_rows_alone(world, stepped, tmp_path):
    """verl's actor (TrainingWorker, FSDP2, ppo_loss with rollout_is_weights) on the spliced batch with the learner's
    own rows' advantages zeroed: the grafted rows alone move the parameters; with their c zeroed too, nothing moves
    (weight decay 0: AdamW's decay would move them without a gradient)."""
    fields = ["input_ids", "position_ids", "prompts", "responses", "response_mask", "loss_mask", "old_log_probs",
              "advantages", "rollout_is_weights"]
    data = tq.kv_batch_get(keys=stepped["batch"].keys, partition_id="train", select_fields=fields)
    grafted = [tag.get("graft") == "peer" for tag in stepped["batch"].tags]
    advantages = [a if g else torch.zeros_like(a) for a, g in zip(data["advantages"].unbind(), grafted)]
    batch = TensorDict({name: data[name] for name in fields}, batch_size=len(grafted))
    batch["advantages"] = torch.nested.as_nested_tensor(advantages, layout=torch.jagged)
    overrides = graft_overrides(world["learner_dir"], None, None) + [
        "actor_rollout_ref.actor.strategy=fsdp2", "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.optim.lr=0.01", "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
    moved = update_actor(batch, overrides, tmp_path, "grafted")
    weights = [w if not g else torch.zeros_like(w) for w, g in zip(data["rollout_is_weights"].unbind(), grafted)]
    batch["rollout_is_weights"] = torch.nested.as_nested_tensor(weights, layout=torch.jagged)
    still = update_actor(batch, overrides, tmp_path, "none")
    print(f"\nlargest parameter change: grafted rows {moved:.3e}, grafted rows' c zeroed {still:.3e}")
    assert moved > 1e-4 and still == 0.0, (moved, still)
