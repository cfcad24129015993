"""The trainer tests' run configuration over the toy world (tests/conftest.py: toy_world), with dotted overrides."""

from __future__ import annotations

from graft.trainer.config import TrainConfig


def make_config(world, run_dir, store_url, **overrides) -> TrainConfig:
    """8 prompts x 4 rollouts of 16 tokens, one mini-batch, GRAFT through `store_url`; overrides: {"optim.lr": 1e-3, "peers.source": "cotrain", ...} (prefetch waits for its lookup:
    never late)."""
    data = {
        "run_dir": str(run_dir), "seed": 0, "steps": 3, "method": "graft", "torch_threads": 1,
        "model": {"path": str(world.learner_dir), "device": "cpu"},
        "data": {"dataset": str(world.problems_path)}, "prompt": {"template": "raw"},
        "rollout": {"backend": "hf", "group_size": 4, "prompts_per_step": 8, "max_response_tokens": 16, "scorer_workers": 1},
        "optim": {"lr": 2e-3, "mini_batch_prompts": 8, "micro_batch_size": 64},
        # the tests of the trainer run the `spec` preset's formulas (b, peer negatives) unless they say otherwise
        "graft": {"peer_tokenizers": [str(world.peer_dir)], "max_grafted_fraction": 0.75, "token_is": "tis",
                  "peer_negative_scale": 1.0},
        "store": {"url": store_url, "timeout_s": 2.0, "retries": 0, "backoff_initial_s": 0.05, "backoff_max_s": 0.1},
        "checkpoint": {"every_steps": 0, "keep_last": None},
        "logging": {"progress": False},
    }
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    peers = data.setdefault("peers", {})
    if peers.get("source", "prefetch") == "prefetch":
        peers.setdefault("lookup_wait_s", 30.0)  # the tests' store answers in milliseconds: never late, whatever the load
    return TrainConfig.model_validate(data)
