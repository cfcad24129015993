"""The learner's reward of grafted rows: what verl trains on is scored by the run's own reward, not the peer's.

A stored peer row carries the peer's reward of its text: its scorer's verdict (a `\\boxed{}` answer that verl's gsm8k
scorer, which wants `#### n`, scores 0) on its scale (0/1 beside `math_dapo`'s +-1, which Dr. GRPO's unnormalised
advantages keep). By default each grafted row is scored the way verl scores its own rollouts: the run's reward loop
(`RewardLoopManager.compute_rm_score`: its reward manager, custom reward function or reward model) on the row's learner
tokens and its prompt's dataset fields (`data_source`, `reward_model.ground_truth`, `extra_info`, ...), which every
trajectory in TransferQueue carries. `graft.peer_reward_map` instead states the learner's reward of each stored reward.
Either way the row's stored verdict (reward > 0) is kept beside the learner's, and the rows whose two verdicts differ
are counted (graft/peer_rows_verdict_changed)."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.protocol import DataProto
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from graft.integrations.verl.config import SINGLE_TURN_AGENT
from graft.trainer import TrainSample

# a trajectory's fields that verl's agent loop produced (AgentLoopOutput.as_dict), not its dataset row: a peer row's
# score must not read the learner's own rollout's (its turns, metrics, tool fields, rewards)
ROLLOUT_FIELDS = frozenset(AgentLoopOutput.model_fields) | {"rm_scores", "rollout_log_probs", "prompts", "responses"}


def _plain(value):
    return value.data if isinstance(value, NonTensorData) else value


def dataset_fields(source: TensorDict) -> dict:
    """A trajectory's dataset row (what verl's agent loop passed its reward loop as kwargs), less its tensors."""
    return {name: _plain(value) for name, value in source.items()
            if name not in ROLLOUT_FIELDS and not isinstance(value, torch.Tensor)}


def rescore(reward_loop_manager, prompts: list[list[int]], rows: list[TrainSample], sources: list[TensorDict],
            pad_id: int) -> list[float]:
    """verl's reward loop's score of each grafted row: its learner tokens after `prompts[k]`, with `sources[k]`'s
    dataset fields, batched as verl's trainer batches its own colocated scoring (`_compute_reward_colocate`:
    right-padded prompts and responses, their attention mask) and passed as its agent loop passes a trajectory's (the
    dataset fields, `__num_turns__`: 2, one user and one assistant turn)."""
    fields = [dataset_fields(source) for source in sources]
    agents = {str(f.get("agent_name")) for f in fields if f.get("agent_name") not in (None, SINGLE_TURN_AGENT)}
    if agents:
        raise NotImplementedError(f"dataset rows name agent loops {sorted(agents)}: grafted rows are scored by the "
                                  "run's reward loop, and these loops may score their rollouts themselves; give the "
                                  "learner's reward of each stored peer reward in graft.peer_reward_map")
    pad = torch.nn.utils.rnn.pad_sequence
    prompt_t = pad([torch.tensor(p) for p in prompts], batch_first=True, padding_value=pad_id)
    response_t = pad([torch.tensor(r.completion_ids) for r in rows], batch_first=True, padding_value=pad_id)
    prompt_mask = PPOTrainer._lengths_to_mask(torch.tensor([len(p) for p in prompts]), prompt_t.size(1))
    response_mask = PPOTrainer._lengths_to_mask(torch.tensor([len(r.completion_ids) for r in rows]), response_t.size(1))
    names = sorted({name for f in fields for name in f})
    non_tensor = {}
    for name in names:
        column = np.empty(len(rows), dtype=object)  # dicts and lists stay one object per row
        column[:] = [f.get(name) for f in fields]
        non_tensor[name] = column
    non_tensor["__num_turns__"] = np.full(len(rows), 2, dtype=object)
    data = DataProto(batch=TensorDict({"prompts": prompt_t, "responses": response_t,
                                       "attention_mask": torch.cat([prompt_mask, response_mask], dim=1)},
                                      batch_size=len(rows)),
                     non_tensor_batch=non_tensor)
    scored = reward_loop_manager.compute_rm_score(data)
    return scored.batch["rm_scores"].sum(-1).tolist()


def mapped(rows: list[TrainSample], mapping: dict[float, float]) -> list[float]:
    """The learner's reward of each row's stored reward, as graft.peer_reward_map states it."""
    missing = sorted({row.reward for row in rows if row.reward not in mapping})
    if missing:
        raise ValueError(f"stored peer rewards {missing} have no entry in graft.peer_reward_map {mapping}: state the "
                         "learner's reward of each")
    return [mapping[row.reward] for row in rows]
