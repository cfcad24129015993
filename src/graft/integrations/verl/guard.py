"""verl's trainers and entry points that do not run GRAFT refuse a config that sets `graft.*`, in one line, instead of
training as plain verl while the user believes the run grafts.

verl builds its v1 trainer by name (`trainer.v1.trainer_mode`: `sync`, `colocate_async`, `separate_async`, or GRAFT's
`graft_sync`), its deprecated v0 trainer (`trainer.use_v1=false`) directly, and its experimental entry points (fully
async, one-step-off) hand `main_ppo.run_ppo` task runners of their own, whose trainers neither use the v1 registry nor
call the v0 trainer's constructor. `install()` (the plugin calls it in every verl process) wraps the three places all
of them pass through: the v1 and v0 trainers' base constructors, where a trainer other than GRAFT's refuses, and
`run_ppo`, where a task runner other than main_ppo's refuses before Ray starts. Each wrapper calls verl's own code.
"""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import DictConfig

from graft.integrations.verl.config import TRAINER_MODE, graft_settings

USE = f"GRAFT runs in `python -m verl.trainer.main_ppo trainer.v1.trainer_mode={TRAINER_MODE}` (verl's sync trainer)"


def refuse_graft(config: Any, where: str) -> None:
    """Raise ValueError when `config` sets graft.*: `where` is what would ignore it."""
    settings = sorted(graft_settings(config)) if isinstance(config, DictConfig) else []
    if settings:
        raise ValueError(f"graft.{', graft.'.join(settings)} is set, but {where} does not graft: {USE}")


def _config_of(args: tuple, kwargs: dict) -> Any:
    return kwargs.get("config", args[0] if args else None)


def _v1_trainer(trainer: Any, config: Any) -> str:
    mode = config.trainer.v1.get("trainer_mode") if isinstance(config, DictConfig) else None
    return f"trainer.v1.trainer_mode={mode} (verl's {type(trainer).__name__})"


def _v0_trainer(trainer: Any, config: Any) -> str:
    return f"verl's {type(trainer).__name__} (the v0 trainer, trainer.use_v1=false, or an entry point's own)"


def _guard_constructor(cls: type, where) -> None:
    """Wrap `cls.__init__` (one it defines itself): a trainer that is not GRAFT's (`grafts_in_verl`) refuses a config
    with graft.*."""
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "graft_guard", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if not getattr(self, "grafts_in_verl", False):
            config = _config_of(args, kwargs)
            refuse_graft(config, where(self, config))
        original(self, *args, **kwargs)

    __init__.graft_guard = True
    cls.__init__ = __init__


def _guard_run_ppo(module: Any) -> None:
    """Wrap `module.run_ppo` (verl.trainer.main_ppo's, which the experimental entry points import when they run): a
    task runner other than main_ppo's refuses a config with graft.* before Ray starts."""
    original = module.run_ppo
    if getattr(original, "graft_guard", False):
        return

    @functools.wraps(original)
    def run_ppo(config, task_runner_class, *args, **kwargs):
        if task_runner_class is not module.TaskRunnerV1:
            name = getattr(getattr(task_runner_class, "__ray_metadata__", None), "class_name", None)
            refuse_graft(config, f"this entry point's task runner ({name or repr(task_runner_class)})")
        return original(config, task_runner_class, *args, **kwargs)

    run_ppo.graft_guard = True
    module.run_ppo = run_ppo


def install() -> None:
    """Guard verl's trainers and `run_ppo` (idempotent)."""
    from verl.trainer import main_ppo
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, PPOTrainer

    # the registered trainers too: one with a constructor of its own (separate_async) checks its settings before
    # calling the base's, and would stop on those first
    for cls in {PPOTrainer, *TRAINER_REGISTRY.values()}:
        if not getattr(cls, "grafts_in_verl", False):
            _guard_constructor(cls, _v1_trainer)
    _guard_constructor(RayPPOTrainer, _v0_trainer)
    _guard_run_ppo(main_ppo)
