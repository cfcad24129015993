"""A graft-train run in a process of its own that pauses after one of its steps, as a long evaluation or checkpoint
would (the lockstep liveness tests' partner; on_step is the loop's hook for it):

    python tests/trainer/helpers/lockstep_partner.py CONFIG.yaml STEP PAUSE_S
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

from graft.trainer.config import TrainConfig
from graft.trainer.loop import train

if __name__ == "__main__":
    config, after, pause_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

    def pause(metrics: dict) -> None:
        if metrics["step"] == after:
            print(f"paused after step {after}", flush=True)
            time.sleep(pause_s)

    train(TrainConfig.model_validate(yaml.safe_load(config.read_text())), on_step=pause)
