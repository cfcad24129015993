"""HF-format checkpoints (save_pretrained of model and tokenizer) with optimizer, scheduler, RNG and
loop state, so `--resume` continues exactly where the run stopped.

Layout: <run_dir>/checkpoints/step_000010/{config.json, model.safetensors, tokenizer files, trainer_state.pt}.
A checkpoint is written into a temporary folder beside its final name and renamed when complete:
a crash never leaves a half-written checkpoint under a final name.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loop_state: dict[str, Any],
    keep_last: int | None,
) -> Path:
    """Write checkpoint `step` atomically and prune older ones beyond `keep_last`; returns its path."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        torch.save(
            {
                "step": step,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
                "loop": loop_state,
            },
            staging / STATE_FILE,
        )
        for f in staging.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # a rerun of the same step (e.g. after resuming) replaces it
            shutil.rmtree(final)
        os.rename(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    if keep_last is not None:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The optimizer/scheduler/RNG/loop state saved beside the model (weights_only=False: our own file)."""
    path = Path(checkpoint) / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {checkpoint} is not a complete trainer checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)
