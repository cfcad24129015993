"""HF-format checkpoints (save_pretrained of model and tokenizer) with optimizer, scheduler, RNG and
loop state, so `--resume` continues exactly where the run stopped.

One process: <run_dir>/checkpoints/step_000010/{config.json, model.safetensors, tokenizer files, trainer_state.pt}.
Data parallel (ddp, fsdp): the same HF files (the full weights, gathered once and written by rank 0)
and, instead of trainer_state.pt, dcp/: a torch.distributed.checkpoint of the sharded model and
optimizer, the scheduler, the loop state (step, data position) and each rank's RNG. It resumes at
the same world size and loads at another one (a 2-rank checkpoint into 1 process, say).

A checkpoint is written into a temporary folder beside its final name and renamed when complete:
a crash never leaves a half-written checkpoint under a final name. With several machines, run_dir
must be a file system they all see (as torch.distributed.checkpoint requires).

keep_last keeps the checkpoints written last (not the highest steps), with checkpoint.optimizer_in_newest_only
only the newest with the optimizer state (`drop_optimizer_state`: the older ones can no longer be resumed), and a
fresh start in a run directory that holds a run is refused (`check_run_dir`): resume it or overwrite it, never
erase it by accident.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from graft.rollouts.files import checkpoint_name, list_checkpoints
from graft.trainer.distributed import DistContext, barrier, broadcast_object, full_state_dict, sum_over_ranks, unwrap

log = logging.getLogger("graft.trainer")

STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "dcp"  # torch.distributed.checkpoint of a data-parallel run (its .metadata is written last)


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
    ctx: DistContext | None = None,
    optimizer_in_newest_only: bool = False,
) -> Path:
    """Write checkpoint `step` atomically and prune older ones beyond `keep_last` (with `optimizer_in_newest_only`,
    drop the optimizer state of the older one-process ones); returns its path.

    Data parallel (ctx.distributed): every rank calls it; each writes its shards and RNG into dcp/,
    rank 0 the HF export and the rename."""
    sharded = ctx is not None and ctx.distributed
    writes_folder = not sharded or ctx.is_main  # creates, renames (or removes) the staging folder
    root = checkpoints_dir(run_dir)
    final = root / checkpoint_name(step)
    staging = None
    if writes_folder:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    if sharded:
        staging = Path(broadcast_object(ctx, str(staging)))
    trainer_state = {"step": step, "scheduler": scheduler.state_dict(), "loop": loop_state}
    try:
        if sharded:
            _write_sharded(staging, model, tokenizer, optimizer, trainer_state, ctx)
        else:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            torch.save({**trainer_state, "optimizer": optimizer.state_dict(), "rng": rng_state()}, staging / STATE_FILE)
        if writes_folder:
            _move_into_place(staging, final, run_dir, keep_last, optimizer_in_newest_only)
        if sharded:
            barrier(ctx)  # no rank returns before the checkpoint is in place
    finally:
        if writes_folder and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _move_into_place(staging: Path, final: Path, run_dir: Path, keep_last: int | None,
                     optimizer_in_newest_only: bool = False) -> None:
    """fsync a complete checkpoint, rename it to its final name, prune beyond keep_last."""
    for folder, _, files in os.walk(staging):
        for name in files:
            with open(Path(folder) / name, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():  # a rerun of the same step (e.g. after resuming) replaces it
        shutil.rmtree(final)
    os.utime(staging)  # the folder's mtime is its place in the write order (list_checkpoints); nothing writes in it after
    os.rename(staging, final)
    if keep_last is not None:
        for old in list_checkpoints(checkpoints_dir(run_dir), resumable)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if optimizer_in_newest_only:
        for older in list_checkpoints(checkpoints_dir(run_dir), resumable)[:-1]:
            drop_optimizer_state(older)


def drop_optimizer_state(checkpoint: Path) -> None:
    """Remove the optimizer state (AdamW's two moments: twice the weights' size) from a one-process checkpoint that is
    no longer the newest (checkpoint.optimizer_in_newest_only): what the older ones are then kept for (a generator's
    watch_dir, an evaluation, a look back) reads their weights; resuming from one is refused. Their step, schedule, RNG and loop state stay. The
    folder keeps its mtime, its place in the write order (list_checkpoints)."""
    path = Path(checkpoint) / STATE_FILE
    if not path.exists():
        return  # a data-parallel checkpoint (dcp/): kept whole
    state = torch.load(path, map_location="cpu", weights_only=False)
    if "optimizer" not in state:
        return
    folder_times = os.stat(checkpoint)
    del state["optimizer"]
    staging = path.with_name(f".{STATE_FILE}.tmp")
    torch.save(state, staging)
    with open(staging, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(staging, path)
    os.utime(checkpoint, ns=(folder_times.st_atime_ns, folder_times.st_mtime_ns))


def resumable(checkpoint: Path) -> bool:
    """Whether a checkpoint holds what --resume needs: the trainer's state (one process) or a sharded checkpoint."""
    return (checkpoint / STATE_FILE).exists() or is_sharded_checkpoint(checkpoint)


class RunDirInUse(FileExistsError):
    """A fresh start was asked for in a run directory that holds a run."""


RUN_FILES = ("metrics.jsonl", "eval.jsonl", "peer_groups.jsonl")  # a run's history beside its checkpoints (tb/ too, when logged)


def previous_run(run_dir: Path) -> list[str]:
    """What of an earlier run `run_dir` holds: its checkpoints and non-empty metrics files (empty: no run there)."""
    found = [name for name in RUN_FILES if (Path(run_dir) / name).is_file() and (Path(run_dir) / name).stat().st_size]
    checkpoints = list_checkpoints(checkpoints_dir(run_dir), resumable)
    if checkpoints:
        found.append(f"{len(checkpoints)} checkpoint(s), the last {checkpoints[-1].name}")
    return found


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> list[str]:
    """Refuse a fresh start where a run is (it would erase that run's metrics and lose its checkpoints to pruning);
    returns what is there, for an overwrite to remove (`clear_run`)."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other: resume continues the run in the run directory, "
                         "overwrite deletes it and starts afresh")
    found = previous_run(run_dir)
    if found and not resume and not overwrite:
        raise RunDirInUse(
            f"{run_dir} holds a run already ({'; '.join(found)}): continue it with --resume, start it over with "
            "--overwrite (deletes its checkpoints and metrics), or give another --run-dir "
            "(in Python: train(cfg, resume=True) or train(cfg, overwrite=True))"
        )
    return found if overwrite else []


def clear_run(run_dir: Path) -> None:
    """Delete a run's checkpoints, metrics, evaluations and TensorBoard scalars (overwrite); its logs and config stay."""
    run_dir = Path(run_dir)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for folder in (checkpoints_dir(run_dir), run_dir / "tb"):
        shutil.rmtree(folder, ignore_errors=True)


def restore_training_state(
    checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, ctx: DistContext | None = None,
) -> dict[str, Any]:
    """Put the optimizer, the schedule and the RNGs back as they were at `checkpoint`; returns the loop's state.

    A data-parallel run's checkpoint (dcp/) loads at any world size, into one process too, its weights and
    optimizer resharded onto this job (`model`, wrapped, and its optimizer built already); a one-process
    checkpoint loads into data-parallel ranks too (its weights are the HF files the policy was loaded from)."""
    ctx = ctx or DistContext("none", torch.device("cpu"))
    if is_sharded_checkpoint(checkpoint):
        loop = load_sharded_checkpoint(checkpoint, model, optimizer, scheduler, ctx)["loop"]
    else:
        saved = load_trainer_state(checkpoint)
        if "optimizer" not in saved:
            raise ValueError(f"{checkpoint} keeps no optimizer state (checkpoint.optimizer_in_newest_only kept it only in "
                             "the run's newest checkpoint): resume from the newest, or start a new run from its weights "
                             "(model.path: this folder)")
        if ctx.strategy == "fsdp" and saved["optimizer"]["state"]:
            _load_full_optimizer_state(model, optimizer, saved["optimizer"])
        else:  # an optimizer that never stepped loads as the fresh one it is (torch's sharded load would step it)
            optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        restore_rng_state(saved["rng"])
        loop = saved["loop"]
    log.info("resumed from %s at step %d", checkpoint, loop["step"])
    return loop


def _load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """A one-process optimizer state (parameters by position) into an FSDP-sharded optimizer: named by the
    trainable parameters in the order the optimizer took them (make_optimizer), then sharded by torch."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, param in unwrap(model).named_parameters() if param.requires_grad]
    named = {
        "state": {names[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The optimizer/scheduler/RNG/loop state saved beside the model (weights_only=False: our own file)."""
    path = Path(checkpoint) / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {checkpoint} is not a complete trainer checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)


def write_run_config(run_dir: Path, config: dict[str, Any], checkpoint: Path | None) -> None:
    """<run_dir>/config.yaml: the run's config as it started. A resumed run keeps it and writes its own beside it
    (config.resumed_at_<step>.yaml) when it differs, naming the fields that changed (e.g. steps, to extend a run)."""
    text = yaml.safe_dump(config, sort_keys=False)
    first = run_dir / "config.yaml"
    if checkpoint is None or not first.exists():
        first.write_text(text)
        return
    before = yaml.safe_load(first.read_text()) or {}
    changed = changed_fields(before, config)
    if changed:
        resumed = run_dir / f"config.resumed_at_{checkpoint.name.removeprefix('step_')}.yaml"
        resumed.write_text(text)
        log.warning("resumed with a config that differs from the run's config.yaml in %s; kept both (this one: %s)",
                    ", ".join(changed), resumed.name)


def changed_fields(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields whose values differ, as `name: old -> new`."""
    changed = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += changed_fields(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changed


# ---- data parallel: torch.distributed.checkpoint ---------------------------------------------------

def is_sharded_checkpoint(checkpoint: Path) -> bool:
    """Whether `checkpoint` holds a data-parallel run's dcp/ state (resume it with load_sharded_checkpoint)."""
    return (Path(checkpoint) / SHARDED_DIR / ".metadata").exists()


def _rng_key(rank: int) -> str:
    return f"rng_rank_{rank:05d}"


def _write_sharded(
    staging: Path, model: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any], ctx: DistContext,
) -> None:
    """Every rank: its shards of model and optimizer and its own RNG into staging/dcp/; rank 0 the HF export. An
    optimizer that never stepped is saved without state (no "optimizer" entry), as one process saves it."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {
        "model": get_model_state_dict(model),
        # One pickled blob: lists whose length varies (grafted prompts) do not fit DCP's fixed layout.
        "trainer": pickle.dumps({**trainer_state, "world_size": ctx.world_size}),
        _rng_key(ctx.rank): pickle.dumps(rng_state()),  # one key per rank: DCP keeps them all
    }
    # torch gives an optimizer without state the state of one step (a step at lr 0 that sets Adam's step count to
    # 1, so that the first real update would take another bias correction): only one that stepped is asked
    if _optimizer_stepped(optimizer, ctx):
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp_save(state, checkpoint_id=staging / SHARDED_DIR)
    export_hf(model, tokenizer, staging, ctx)
    barrier(ctx)  # every rank's files are written before rank 0 renames the folder


def _optimizer_stepped(optimizer: torch.optim.Optimizer, ctx: DistContext) -> bool:
    """Whether the optimizer holds state (AdamW from its first step on). The ranks step together, so they agree;
    one collective checks it (DCP's save plan must be the same on every rank)."""
    stepped = sum_over_ranks(ctx, int(bool(optimizer.state)))
    if stepped not in (0, ctx.world_size):
        raise RuntimeError(f"the optimizers of {stepped} of {ctx.world_size} ranks have stepped: the ranks are out of "
                           "step (they must take every optimizer step together)")
    return stepped > 0


def load_sharded_checkpoint(
    checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, ctx: DistContext
) -> dict[str, Any]:
    """Every rank calls it, at any world size and strategy (a 2-rank fsdp checkpoint loads into one
    plain process): model and optimizer are resharded onto this job, the scheduler and this rank's
    RNG are restored. Returns {"step", "loop", "world_size"} as saved. The model and optimizer must be
    built (and wrapped) already; an optimizer saved without state (it had never stepped) is left without any."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    directory = Path(checkpoint) / SHARDED_DIR
    if not (directory / ".metadata").exists():
        raise FileNotFoundError(f"{directory}/.metadata is missing: {checkpoint} is not a complete data-parallel checkpoint")
    saved_keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    state: dict[str, Any] = {"model": get_model_state_dict(model), "trainer": b""}
    saved_optimizer = any(key.startswith("optimizer.") for key in saved_keys)
    if saved_optimizer:  # torch steps a fresh optimizer once to lay out its state; the loaded values replace it
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    has_rng = _rng_key(ctx.rank) in saved_keys
    if has_rng:
        state[_rng_key(ctx.rank)] = b""
    with warnings.catch_warnings():  # one process reading a sharded checkpoint is what we mean; DCP warns about it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, checkpoint_id=directory, no_dist=not ctx.distributed)
    set_model_state_dict(model, state["model"])
    if saved_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    else:
        optimizer.state.clear()  # as saved: no step taken
    trainer = pickle.loads(state["trainer"])  # our own file
    scheduler.load_state_dict(trainer["scheduler"])
    if has_rng:
        restore_rng_state(pickle.loads(state[_rng_key(ctx.rank)]))
    else:
        log.warning("%s was written by %d ranks: rank %d has no saved RNG state and keeps the one it was seeded with",
                    checkpoint, trainer["world_size"], ctx.rank)
    if trainer["world_size"] != ctx.world_size:
        log.warning("%s was written by %d ranks and loads into %d: weights and optimizer continue exactly, sampling "
                    "does not repeat what the old job would have drawn", checkpoint, trainer["world_size"], ctx.world_size)
    return {"step": trainer["step"], "loop": trainer["loop"], "world_size": trainer["world_size"]}


def export_hf(model: torch.nn.Module, tokenizer: Any, directory: Path, ctx: DistContext) -> None:
    """save_pretrained of the full weights (gathered once onto rank 0's CPU) and the tokenizer into
    `directory`, by rank 0: what transformers, vLLM and graft-generate (watch_dir) load. Every rank
    calls it (the gather is a collective)."""
    weights = full_state_dict(model, ctx)
    if ctx.is_main:
        # A tied parameter (lm_head = embed_tokens) comes back from the gather once per name, as copies that
        # save_pretrained cannot see are one: keep its first name, so the files are the unsharded model's own.
        first_name: dict[int, str] = {}
        for name, tensor in unwrap(model).state_dict(keep_vars=True).items():
            first_name.setdefault(id(tensor), name)
        weights = {name: tensor for name, tensor in weights.items() if name in set(first_name.values())}
        # transformers names the architecture after the class, less FSDP2's "FSDP" prefix
        unwrap(model).save_pretrained(directory, state_dict=weights)
        tokenizer.save_pretrained(directory)

