"""`graft-train`: GRPO / GRAFT / DAPO training from a YAML config with command-line overrides.

    graft-train train --config configs/train_toy.yaml --model demo_out/models/learner-<hash>/starts/early  # after make demo
    graft-train train --config configs/train_toy.yaml --method grpo --steps 50   # the baseline, same code path
    graft-train train --config configs/train_toy.yaml --resume     # continue from the newest checkpoint (none: start)
    graft-train train --config configs/train_toy.yaml --overwrite  # delete the run in the run directory, start afresh
    graft-train show-config --config configs/train_toy.yaml        # every field, its value and its doc line
    graft-train replay runs/graft --run-dir runs/graft-replay      # rerun a run from its recorded peer groups

The config is `--config PATH`, as graft-generate's and graft-eval's (graft.schemas.overrides); the positional form of
earlier releases (`graft-train train CONFIG`) still runs, with a deprecation warning. Also runs as
`python -m graft.trainer.cli`, which is how torchrun starts ranks (`torchrun ... -m graft.trainer.cli train --config CONFIG`).
"""

from __future__ import annotations

import enum
import logging
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from graft.schemas.overrides import add_show_config, command_line_config
from graft.trainer.config import PEER_SOURCES, TrainConfig, missing_inputs

PeerSourceName = enum.Enum("PeerSourceName", {name: name for name in PEER_SOURCES}, type=str)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train a policy with GRPO, GRAFT or DAPO (GRAFT: docs/algorithm.md).")


def _named(
    model: str | None, peer_models: str | None, dataset: str | None, store_url: str | None, method: str | None,
    source: str | None, steps: int | None, group_size: int | None, prompts_per_step: int | None, lr: float | None,
    seed: int | None, run_dir: Path | None,
) -> dict[str, object]:
    """The named options by the dotted fields they set (None: not given); `--set` pairs come after them and win."""
    peers = None if peer_models is None else [m.strip() for m in peer_models.split(",") if m.strip()]
    return {
        "model.path": model, "data.dataset": dataset, "store.url": store_url, "method": method,
        # a source of its own settings: --peers replaces the config's peers section (--set peers.<x> then sets them)
        "peers": None if source is None else {"source": source},
        "steps": steps, "rollout.group_size": group_size, "rollout.prompts_per_step": prompts_per_step, "optim.lr": lr,
        "seed": seed, "run_dir": str(run_dir) if run_dir is not None else None, "graft.peer_models": peers,
    }


def _config_path(config: Path | None, positional: Path | None, command: str) -> Path | None:
    """--config, or the positional path of earlier releases (said to be deprecated)."""
    if positional is None:
        return config
    if config is not None:
        typer.echo(f"error: the config given twice ({positional} and --config {config}): give --config only", err=True)
        raise typer.Exit(2)
    typer.echo(f"warning: `graft-train {command} CONFIG` is deprecated: write `graft-train {command} --config "
               f"{positional}` (as graft-generate and graft-eval take it)", err=True)
    return positional


def _check_inputs(cfg: TrainConfig, skip: bool) -> None:
    missing = [] if skip else missing_inputs(cfg)
    if missing:
        raise typer.BadParameter("the configuration names inputs that are not there or cannot be read:\n" + "\n".join(f"  {m}" for m in missing))


@app.command()
def train(
    positional: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", show_default=False,
                                                         help="deprecated: --config CONFIG")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config (see configs/train*.yaml); named "
                                                   "options and --set override it")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="learner model path (model.path)")] = None,
    peer_models: Annotated[Optional[str], typer.Option("--peer-models", help="comma-separated peer model ids to accept")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="training problems (data.dataset)")] = None,
    store_url: Annotated[Optional[str], typer.Option("--store-url", help="store base URL (store.url)")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help="grpo | graft | dapo")] = None,
    peers: Annotated[Optional[PeerSourceName], typer.Option("--peers", help="how peer groups arrive (peers.source, the config's peers section replaced: --set peers.<setting> after it): prefetch (read the store), cotrain (publish, wait a bounded time for the co-trainer), lockstep (publish, take the partner's groups of each step), replay (see graft-train replay)")] = None,
    old_mode: Annotated[Optional[bool], typer.Option("--cotrain/--offline", hidden=True)] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="training steps")] = None,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="rollouts per prompt (rollout.group_size)")] = None,
    prompts_per_step: Annotated[Optional[int], typer.Option("--prompts-per-step", help="prompt batch (rollout.prompts_per_step)")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="learning rate (optim.lr)")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="run seed")] = None,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="output directory")] = None,
    sets: Annotated[list[str], typer.Option("--set", help="dotted override, e.g. --set graft.peer_negative_scale=0 (repeatable)")] = [],
    resume: Annotated[bool, typer.Option("--resume", help="continue from the newest checkpoint in the run directory (none there: a fresh run)")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="delete the run the run directory holds (checkpoints, metrics) and start afresh")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log INFO messages to stderr")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="validate the configuration and its input paths, print it as YAML and exit")] = False,
    skip_path_check: Annotated[bool, typer.Option("--skip-path-check", help="do not check that the model and data paths exist (they are another machine's, e.g. a container's mounts)")] = False,
) -> None:
    """Train; metrics go to <run_dir>/metrics.jsonl, checkpoints to <run_dir>/checkpoints/.

    A run directory that holds a run is refused unless --resume or --overwrite says what to do with it. SIGTERM
    stops at the next step boundary (checkpoint written, groups pushed) and exits 0."""
    if resume and overwrite:
        raise typer.BadParameter("--resume continues the run in the run directory, --overwrite deletes it: give one")
    if old_mode is not None:
        raise typer.BadParameter("--cotrain and --offline are gone: how peer groups arrive is one setting, --peers "
                                 "(--cotrain: --peers cotrain, or lockstep; --offline: --peers prefetch)")
    cfg = command_line_config(TrainConfig, _config_path(config, positional, "train"), sets, _named(
        model, peer_models, dataset, store_url, method, peers.value if peers else None, steps, group_size, prompts_per_step, lr, seed, run_dir))
    if dry_run:
        import yaml

        _check_inputs(cfg, skip_path_check)
        typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        typer.echo(f"# {cfg.grafting()}")
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and cfg.parallel.strategy == "none":  # each rank would train a model of its own on the same data
        raise typer.BadParameter(
            f"torchrun started {world_size} ranks (WORLD_SIZE={world_size}) but parallel.strategy is 'none': set "
            "--set parallel.strategy=fsdp (or ddp), or start one process"
        )
    _check_inputs(cfg, skip_path_check)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the trainer's own messages
    _run(cfg, resume, overwrite)


def _run(cfg: TrainConfig, resume: bool, overwrite: bool) -> None:
    from graft.trainer.checkpoint import RunDirInUse
    from graft.trainer.loop import train as run_training
    from graft.trainer.peers import PartnerGone
    from graft.trainer.replay import ReplayMismatch

    try:
        out = run_training(cfg, resume=resume, overwrite=overwrite)
    except RunDirInUse as error:
        raise typer.BadParameter(str(error)) from None
    except (PartnerGone, ReplayMismatch) as error:  # said in a line, without a traceback: nothing in the code failed
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"run directory: {out}")


@app.command()
def replay(
    recorded: Annotated[Path, typer.Argument(help="the run directory to replay (its config.yaml and peer_groups.jsonl)")],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="where the replay writes (not the recorded run's directory)")],
    store_url: Annotated[Optional[str], typer.Option("--store-url", help="the store holding the run's peer groups (default: the run's store.url)")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="replay only the run's first N steps")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="delete a run already in --run-dir first")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log INFO messages to stderr")] = False,
) -> None:
    """Rerun a GRAFT run from its recorded peer groups (the run's config with peers.source replay): each step grafts
    exactly the groups the run did, fetched from the store by id and checked by hash; no lookup, no partner, nothing
    published; the first step whose own rewards or grafts differ from the record stops it, naming what differed. Its
    metrics equal the run's but for the times (*_s) and the store call counts (store_*)."""
    sets = [f"run_dir={run_dir}"] + ([f"store.url={store_url}"] if store_url else []) \
        + ([f"steps={steps}"] if steps is not None else [])
    cfg = command_line_config(TrainConfig, recorded / "config.yaml", sets,
                              {"peers": {"source": "replay", "run_dir": str(recorded)}})
    _check_inputs(cfg, False)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _run(cfg, resume=False, overwrite=overwrite)


add_show_config(app, TrainConfig, summary=TrainConfig.grafting)


if __name__ == "__main__":
    app()
