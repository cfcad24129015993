"""GRAFT inside TRL: `GraftGRPOTrainer` is TRL's GRPOTrainer that grafts peer groups from the store into its
all-fail groups; `GraftConfig` is TRL's GRPOConfig with the store and graft-train's GRAFT options.
Needs the `trl` extra (`pip install '.[trl]'`)."""

from graft.integrations.trl.config import GraftConfig
from graft.integrations.trl.trainer import GraftGRPOTrainer

__all__ = ["GraftConfig", "GraftGRPOTrainer"]
