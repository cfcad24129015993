"""`graft-rescore`: fill in the behaviour logprobs (mu) of stored groups from the peer's weights, teacher-forced.

    graft-rescore --store stores/local --source-model r1-traces --model models/peer
    graft-rescore --store stores/local --source-model r1-traces --model models/peer --backend openai \\
        --set sampler.base_url=http://127.0.0.1:8000
    graft-rescore show-config    # every field, its default and its doc line

Each rescored group is written as a new group at the sampling its rows state (logprobs_mode 'rescored' when the
weights' fingerprint is the rows' model_revision, else 'rescored_unverified'; the weights' revision; the prompt the
rows kept, else one rebuilt from the problem); the source groups stay as they are. A group whose stated sampling the
backend cannot apply is refused. A second run skips what the first stored."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from graft.schemas.overrides import add_show_config, command_line_config
from graft.services.generator.config import RescoreConfig, print_summary

app = typer.Typer(add_completion=False, invoke_without_command=True, help=__doc__)


def _help(name: str) -> str:
    return RescoreConfig.model_fields[name].description or ""


@app.callback()
def rescore(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML file with RescoreConfig fields; flags and --set override it"),
    store: Optional[str] = typer.Option(None, help=_help("store")),
    source_model: Optional[str] = typer.Option(None, help=_help("source_model")),
    model: Optional[str] = typer.Option(None, help=_help("model")),
    model_id: Optional[str] = typer.Option(None, help=_help("model_id")),
    backend: Optional[str] = typer.Option(None, help="what teacher-forces (sampler.backend, the config's sampler section "
                                          "replaced: --set sampler.<setting> after it): hf (transformers, in this "
                                          "process) or openai (a vLLM server's prompt_logprobs: --set "
                                          "sampler.base_url=...)"),
    sets: list[str] = typer.Option([], "--set", help="any field as field=value, e.g. --set prompt.template=raw (repeatable; "
                                   "`graft-rescore show-config` lists them)"),
    summary_json: Optional[Path] = typer.Option(None, help="also write the JSON summary to this file (whole or not at all)"),
) -> None:
    """Teacher-force a model's stored groups through the peer's weights and store them again with mu.

    A group that cannot be rescored (its stated sampling one the backend cannot apply, its prompt unknown, a token the
    weights give probability 0) is one line on stderr and counted; the summary is stdout's last line (JSON).
    """
    if ctx.invoked_subcommand:  # show-config
        return
    named = {"store": store, "source_model": source_model, "model": model, "model_id": model_id,
             "sampler": None if backend is None else {"backend": backend}}  # as graft-generate's --backend
    cfg = command_line_config(RescoreConfig, config, sets, named)

    from graft.rollouts.openai_backend import ServerError
    from graft.services.generator.rescoring import run_rescore

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        stats = run_rescore(cfg, on_failed_group=lambda line: typer.echo(f"not rescored: {line}", err=True))
    except (ServerError, FileNotFoundError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    summary = stats.summary(cfg.sampler.backend)
    print_summary(summary, summary_json)


add_show_config(app, RescoreConfig)

if __name__ == "__main__":
    app()
