"""The shared rollout layer: models, prompts, sampling backends, scoring, datasets (imports no service)."""
