"""verl's plugin entry point (`verl.plugins` in pyproject): importing it registers `GraftPPOTrainer` as
`trainer.v1.trainer_mode=graft_sync` in every verl process that imports verl, and makes verl's other trainers and entry
points refuse a config that sets `graft.*` (guard.py) instead of ignoring it.

verl loads entry-point plugins at `import verl` and logs a failed one at DEBUG only (the run then stops with
"Unknown trainer 'graft_sync'"); `VERL_USE_EXTERNAL_MODULES=graft.integrations.verl.plugin` imports it so that a failure
raises with its cause (docs/verl.md)."""

from graft.integrations.verl import guard
from graft.integrations.verl.trainer import GraftPPOTrainer

guard.install()

__all__ = ["GraftPPOTrainer"]
