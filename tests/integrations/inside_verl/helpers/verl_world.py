"""What the verl tests build: verl's real config (Hydra, its own ppo_trainer.yaml), a toy learner with a chat template
and a peer with another tokenizer, peer groups in a store, and verl's TransferQueue on loopback Ray.

`RecordedRollouts` is the one stand-in: verl generates only through vLLM / SGLang servers (GPU), so it writes each
prompt's rollout.n trajectories into TransferQueue as verl's `AgentLoopWorkerTQ._agent_loop_postprocess` does
(verl/trainer/ppo/v1/agent_loop_tq.py:160-227: verl's `AgentLoopOutput.as_dict`, the `{uid}_{session}_{index}` keys,
the length tags, then the prompt's `finished` status), with completions the test chooses and their teacher-forced
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
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "data.max_response_length=16",
        # transformers' own attention: verl's default asks for flash_attention_2, which needs flash-attn (a GPU build)
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
    ]
    if store_url is not None:
        settings += [f"+graft.store_url={store_url}", "+graft.lookup_wait_s=30",
                     "+graft.options.max_grafted_fraction=1.0",
                     # the `spec` preset's formulas (b, peer negatives): the tests check b and the peer's negative rows
                     "+graft.options.token_is=tis", "+graft.options.peer_negative_scale=1.0"]
    if peer_dir is not None:
        settings.append(f"+graft.peer_tokenizers=[{peer_dir}]")
    return settings


@dataclass
class Planned:
    """A prompt's learner completions (texts) and their rewards."""

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

        for i, uid in enumerate(list(batch["uid"])):
            extra_info = batch["extra_info"][i]
            plan = self.plans[extra_info["prompt_id"]]
            messages = list(batch["raw_prompt"][i])
            prompt_ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))
            keys, fields, tags = [], [], []
            for session, (text, reward) in enumerate(zip(plan.texts, plan.rewards, strict=True)):
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                with torch.no_grad():
                    logprobs = teacher_forced_logprobs(self.model, prompt_ids, ids, SamplingParams(n=1))
                output = AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids, response_mask=[1] * len(ids),
                                         response_logprobs=logprobs, reward_score=reward, num_turns=2,
                                         metrics=AgentLoopMetrics())
                field: dict[str, Any] = output.as_dict()
                field.update(uid=uid, session_id=session, raw_prompt=messages, extra_info=extra_info,
                             global_steps=1, index=0)
                input_ids = torch.cat([field["prompts"], field["responses"]])
                field.update(loss_mask=field["response_mask"], input_ids=input_ids,
                             position_ids=compute_position_id_with_mask(torch.ones_like(input_ids)[None])[0])
                keys.append(f"{uid}_{session}_0")
                fields.append(field)
                tags.append({"status": "success", "prompt_len": len(prompt_ids), "response_len": len(ids),
                             "seq_len": len(prompt_ids) + len(ids), "global_steps": 1, "min_global_steps": 1,
                             "max_global_steps": 1})
            tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id="train")
            tq.kv_put(key=uid, partition_id="train", tag={"status": "finished"})


def prompt_batch(problems: list[Problem]):
    """One dataloader batch of `problems` as verl's `_fetch_one_gen_batch` hands it to `_submit_batch_to_rollout`
    (RLHFDataset's rows: the chat prompt, extra_info with the store's prompt id, a uid per prompt)."""
    import uuid

    import numpy as np
    from verl.utils import tensordict_utils as tu

    rows = {
        "raw_prompt": [[{"role": "user", "content": p.problem}] for p in problems],
        "extra_info": [{"prompt_id": p.prompt_id, "index": i} for i, p in enumerate(problems)],
        "uid": np.array([str(uuid.uuid4()) for _ in problems], dtype=object),
    }
    batch = tu.get_tensordict(rows)
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    return batch
