"""What the verl tests build: verl's real config (Hydra, its own ppo_trainer.yaml), a toy learner with a chat template
and a peer with another tokenizer, peer groups in a store, and verl's TransferQueue on loopback Ray.

`RecordedRollouts` is the one stand-in: verl generates only through vLLM / SGLang servers (GPU), so it writes each
prompt's trajectories into TransferQueue as verl's `AgentLoopWorkerTQ._agent_loop_postprocess` does
(verl/trainer/ppo/v1/agent_loop_tq.py:160-227: verl's `AgentLoopOutput.as_dict` with the dataset row's fields, the
`{uid}_{session}_{index}` keys, the length tags, then the prompt's `finished` status, or `failure` when some of its
sessions failed and left no trajectory), with completions and rewards the test chooses and their teacher-forced
logprobs under the learner as the sampler's logprobs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from graft.rollouts.hf_backend import teacher_forced_logprobs
from graft.rollouts.sampling import SamplingParams
from graft.schemas import Problem

GROUP = 4  # rollout.n
# verl's scorer of `\boxed{}` answers, 0/1 (verl.utils.reward_score.math_reward), chosen by the rows' data_source
TOY_SOURCE = "lighteval/MATH"


def verl_config(overrides: list[str]) -> DictConfig:
    """verl's own ppo_trainer config (the one `python -m verl.trainer.main_ppo` composes) with `overrides`."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def graft_overrides(learner_dir: Path, store_url: str | None, peer_dir: Path | None, prompts: int = 3) -> list[str]:
    """The settings docs/verl.md tells a verl user to change, on a run of `prompts` prompts x GROUP rollouts."""
    settings = [
        "trainer.v1.trainer_mode=graft_sync",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={learner_dir}",
        f"actor_rollout_ref.rollout.n={GROUP}",
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # a DP rank's 6 rows: 3 micro-batches
        "data.max_response_length=16",
        # what docs/verl.md sets: verl's default asks for flash_attention_2, which needs flash-attn (a GPU build)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "reward.num_workers=1",  # verl's reward loop (the learner's reward of grafted rows): one Ray worker here
    ]
    if store_url is not None:
        settings += [f"+graft.store_url={store_url}", "+graft.options.max_grafted_fraction=1.0",
                     # the `spec` preset's formulas (b, peer negatives): the tests check b and the peer's negative rows
                     "+graft.options.token_is=tis", "+graft.options.peer_negative_scale=1.0"]
    if peer_dir is not None:
        settings.append(f"+graft.peer_tokenizers=[{peer_dir}]")
    return settings


@dataclass
class Planned:
    """A prompt's learner completions (texts) and their rewards; fewer than GROUP: the others' sessions failed."""

    problem: Problem
    texts: list[str]
    rewards: list[float]


class RecordedRollouts:
    """verl's agent loop manager in the tests (its `generate_sequences(batch)`), writing the planned completions."""

    def __init__(self, model, tokenizer, plans: dict[str, Planned]):
        self.model, self.tokenizer, self.plans = model, tokenizer, plans  # plans by prompt id

    def generate_sequences(self, batch) -> None:
        import transfer_queue as tq
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
        from verl.utils.model import compute_position_id_with_mask
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        from tensordict import NonTensorStack

        # the per-row fields (the batch's own, such as global_steps, are not a row's)
        dataset_fields = [name for name in batch.keys() if isinstance(batch.get(name), NonTensorStack)]
        for i, uid in enumerate(list(batch["uid"])):
            row = {name: batch[name][i] for name in dataset_fields}  # what verl's agent loop gets as kwargs
            plan = self.plans[row["extra_info"]["prompt_id"]]
            messages = list(row["raw_prompt"])
            prompt_ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))
            keys, fields, tags = [], [], []
            for session, (text, reward) in enumerate(zip(plan.texts, plan.rewards, strict=True)):
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                with torch.no_grad():
                    logprobs = teacher_forced_logprobs(self.model, prompt_ids, [ids], SamplingParams(n=1))[0]
                output = AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids, response_mask=[1] * len(ids),
                                         response_logprobs=logprobs, reward_score=reward, num_turns=2,
                                         metrics=AgentLoopMetrics())
                field: dict[str, Any] = output.as_dict()
                field.update(row, uid=uid, session_id=session, global_steps=1)
                input_ids = torch.cat([field["prompts"], field["responses"]])
                field.update(loss_mask=field["response_mask"], input_ids=input_ids,
                             position_ids=compute_position_id_with_mask(torch.ones_like(input_ids)[None])[0])
                keys.append(f"{uid}_{session}_0")
                fields.append(field)
                tags.append({"status": "success", "prompt_len": len(prompt_ids), "response_len": len(ids),
                             "seq_len": len(prompt_ids) + len(ids), "global_steps": 1, "min_global_steps": 1,
                             "max_global_steps": 1})
            if keys:
                tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id="train")
            # verl's status of a prompt some of whose sessions failed (they leave no trajectory)
            status = "finished" if len(plan.texts) == GROUP else "failure"
            tq.kv_put(key=uid, partition_id="train", tag={"status": status})


def prompt_batch(problems: list[Problem], data_source: str = TOY_SOURCE):
    """One dataloader batch of `problems` as verl's `_fetch_one_gen_batch` hands it to `_submit_batch_to_rollout`:
    RLHFDataset's rows (the chat prompt, data_source, the ground truth, extra_info with the store's prompt id and the
    problem text, ...),
    a uid per prompt."""
    import uuid

    import numpy as np
    from verl.utils import tensordict_utils as tu

    rows = {
        "raw_prompt": [[{"role": "user", "content": p.problem}] for p in problems],
        "data_source": [data_source] * len(problems),
        "ability": ["math"] * len(problems),
        "reward_model": [{"style": "rule", "ground_truth": p.answer} for p in problems],
        "extra_info": [{"prompt_id": p.prompt_id, "index": i, "problem": p.problem} for i, p in enumerate(problems)],
        "index": list(range(len(problems))),
        "uid": np.array([str(uuid.uuid4()) for _ in problems], dtype=object),
    }
    batch = tu.get_tensordict(rows)
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    return batch


# ---- the world and a step of the trainer, shared by the step tests ---------------------------------------------------

PEER_SIZES = (4, 3)  # the two failed prompts' peer groups: the second leaves one of the G slots empty
DP = 2  # the actor's data-parallel size in the tests (verl's dispatch info)


def build_world(root: Path) -> dict:
    """Three prompts of G = 4: one the learner solves sometimes, two it fails; the store holds a peer group (another
    tokenizer) for each failed prompt, of PEER_SIZES rollouts (rewards 1, 0, 1, ...: `\\boxed{}` right or wrong)."""
    from graft.services.store_api.local.shards import write_groups
    from toy.models import build_tiny_model, save_model
    from toy.task import completion_text, sample_problems
    from toy.world import cached_chat_model, peer_tokenizer

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
    groups = [peer_group(problem, [completion_text(problem.answer) if k % 2 == 0 else completion_text("0")
                                   for k in range(size)], [1.0 if k % 2 == 0 else 0.0 for k in range(size)],
                         peer_tok, peer)
              for problem, size in zip(problems[1:], PEER_SIZES)]
    store_root = root / "store"
    write_groups(store_root, groups, problems)
    return {"root": root, "learner_dir": learner_dir, "peer_dir": peer_dir, "peer": peer, "peer_tok": peer_tok,
            "problems": problems, "plans": plans, "groups": groups, "store_root": store_root}


def peer_group(problem: Problem, texts: list[str], rewards: list[float], tokenizer, model):
    """The toy peer's stored group of `texts` with the rewards its scorer gave them."""
    from graft.rollouts.models import tokenizer_fingerprint
    from toy.world import build_group

    return build_group(problem, texts, rewards, tokenizer, model, model_id="toy-peer",
                       tokenizer_id=tokenizer_fingerprint(tokenizer))


def build_trainer(world: dict, store_url: str | None, learner, reward_loop, extra: tuple[str, ...] = (),
                  plans: dict | None = None):
    """verl's trainer object as main_ppo builds it, up to the workers (they need a GPU): its real __init__, its own
    tokenizer (`_init_tokenizer`), GRAFT's part of `_setup`, verl's reward loop, and the generation stand-in as its
    agent loop manager."""
    from graft.integrations.verl.trainer import GraftPPOTrainer

    config = verl_config(graft_overrides(world["learner_dir"], store_url,
                                         world["peer_dir"] if store_url is not None else None) + list(extra))
    trainer = GraftPPOTrainer(config)
    trainer._init_tokenizer()
    if store_url is not None:
        trainer.graft = trainer.graft_setup()
    trainer.reward_loop_manager = reward_loop
    trainer.global_steps = 1
    trainer.agent_loop_manager = RecordedRollouts(learner, trainer.tokenizer, plans or world["plans"])
    return trainer


def actor_worker_group(learner, train=None):
    """verl's actor worker group in the tests: a real `WorkerGroup` of DP ranks with the actor mesh's dispatch info, so
    that verl's `_balance_batch` and dispatch run as on DP GPUs. `compute_log_prob(batch)`: the learner's forward pass
    at the rollout temperature (1), written to TransferQueue as verl's worker writes it (`log_probs` and `entropy` in the
    model's output layout: one value per sequence token, the response's shifted left by one), which verl's
    `_compute_old_log_prob` turns into `old_log_probs`. `update_actor(batch)`: verl's dispatch of the batch to the DP
    ranks (`dispatch_lazy_compute_data_proto`, the actor mesh's), each rank's chunk read as verl's tqbridge reads it,
    then `train(chunks)` (a real actor update, test_splice's) returning its metrics."""
    import ray
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.single_controller.base.decorator import dispatch_lazy_compute_data_proto
    from verl.single_controller.base.worker_group import WorkerGroup

    class ActorGroup(WorkerGroup):
        def __init__(self):
            super().__init__(resource_pool=None)
            self._workers = [None] * DP
            self._dispatch_info = {"actor": list(range(DP))}
            self.dispatched = []  # the per-rank chunks (KVBatchMeta) of each update

        def compute_log_prob(self, batch):
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts", "responses"])
            rows = []
            with torch.no_grad():
                for prompt, response in zip(data["prompts"].unbind(), data["responses"].unbind()):
                    ids = torch.cat([prompt, response])[None]
                    logits = learner(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                    values = logits.log_softmax(-1).gather(1, response[:, None])[:, 0]
                    rows.append(torch.cat([torch.zeros(len(prompt) - 1), values, torch.zeros(1)]))
            log_probs = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
            entropy = torch.nested.as_nested_tensor([torch.zeros_like(r) for r in rows], layout=torch.jagged)
            return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                   fields=TensorDict({"log_probs": log_probs, "entropy": entropy}, batch_size=len(rows)))

        def update_actor(self, batch):
            args, _ = dispatch_lazy_compute_data_proto("actor", self, batch)
            chunks = [ray.get(ref) for ref in args[0]]
            self.dispatched.append(chunks)
            metrics = train(chunks) if train is not None else {}
            return {"metrics": {"mfu": 0.0, **metrics}}

    return ActorGroup()


def step_to_the_actor(trainer, learner, problems, data_source: str = TOY_SOURCE):
    """One step of `trainer` as verl's `_step_once` runs it, up to the actor's update: submit (the lookup starts),
    sample from verl's replay buffer, `_balance_batch` (the splice, then verl's upsampling to the batch multiple and its
    reorder for DP ranks), verl's pi_old, verl's advantages and GRAFT's weights. Returns (the balanced batch, the meta
    `_compute_advantage` hands to `_update_actor`, the splice, the metrics)."""
    if not hasattr(trainer, "actor_rollout_wg"):
        trainer.actor_rollout_wg = actor_worker_group(learner)
    trainer._submit_batch_to_rollout(prompt_batch(problems, data_source))
    batch, _ = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=len(problems))
    metrics: dict = {}
    batch = trainer._balance_batch(batch, metrics)
    splice = trainer.graft_splice
    batch = trainer._compute_old_log_prob(batch, metrics)
    meta = trainer._compute_advantage(batch, metrics)
    return batch, meta, splice, metrics
