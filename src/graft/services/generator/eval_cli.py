"""`graft-eval`: avg@k and pass@k of a model on the math benchmarks, as JSON and a Markdown table.

    graft-eval --model models/peer -b gsm8k --limit 50 --k 4 --set max_tokens=512
    graft-eval show-config                  # every field, its default and its doc line

Every EvalConfig field is `--set field=value` (the per-field flags of earlier releases, `--max-tokens 512`, are gone:
`--set max_tokens=512`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from graft.schemas.overrides import add_show_config, command_line_config
from graft.services.generator.config import EvalConfig

app = typer.Typer(add_completion=False, invoke_without_command=True, help=__doc__)


def _help(name: str) -> str:
    return EvalConfig.model_fields[name].description or ""


@app.callback()
def evaluate_model(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML file with EvalConfig fields; flags and --set override it"),
    model: Optional[str] = typer.Option(None, help=_help("model")),
    model_id: Optional[str] = typer.Option(None, help=_help("model_id")),
    backend: Optional[str] = typer.Option(None, help="which backend samples (sampler.backend, the config's sampler section "
                                          "replaced: --set sampler.<setting> after it): hf (transformers), vllm, or "
                                          "openai (a completions server: --set sampler.base_url=...)"),
    benchmark: Optional[list[str]] = typer.Option(None, "--benchmark", "-b", help=_help("benchmarks") + " (repeat the flag)"),
    limit: Optional[int] = typer.Option(None, help=_help("limit")),
    k: Optional[int] = typer.Option(None, "--k", "-k", help=_help("k")),
    sets: list[str] = typer.Option([], "--set", help="any field as field=value, e.g. --set max_tokens=1024 (repeatable; "
                                   "`graft-eval show-config` lists them)"),
) -> None:
    """Evaluate a model: greedy when k = 1, else temperature 0.6 and top_p 0.95 unless given.

    Any field: --set field=value (`graft-eval show-config` lists them).
    """
    named = {"model": model, "model_id": model_id, "benchmarks": benchmark or None, "limit": limit, "k": k,
             # a backend takes its own settings: --backend replaces the config's sampler section
             "sampler": None if backend is None else {"backend": backend}}
    if ctx.invoked_subcommand:  # show-config
        return
    cfg = command_line_config(EvalConfig, config, sets, named)

    from graft.rollouts.backends import load_backend
    from graft.rollouts.datasets import load_problems
    from graft.rollouts.evaluation import evaluate, markdown_table
    from graft.rollouts.files import write_text_atomic
    from graft.rollouts.models import default_model_id
    from graft.rollouts.openai_backend import ServerError
    from graft.rollouts.sampling import SamplingParams

    greedy = cfg.k == 1
    temperature_ = cfg.temperature if cfg.temperature is not None else (0.0 if greedy else 0.6)
    top_p_ = cfg.top_p if cfg.top_p is not None else (1.0 if greedy else 0.95)
    params = SamplingParams(n=cfg.k, temperature=temperature_, top_p=top_p_, max_tokens=cfg.max_tokens, seed=cfg.seed)
    try:
        problems = {name: load_problems(name, limit=cfg.limit) for name in cfg.benchmarks}
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    model_id_ = cfg.model_id or default_model_id(cfg.model)
    try:
        backend_ = load_backend(cfg.sampler, cfg.model, model_id=model_id_, seed=cfg.seed or 0)
        try:
            with cfg.scoring.scorer() as scorer:
                result = evaluate(backend_, problems, cfg.k, params, scorer, prompt=cfg.prompt,
                                  prompts_per_batch=cfg.prompts_per_batch, progress=cfg.progress)
        finally:
            backend_.close()
    except ServerError as e:  # a served model's failure: one line, not a crash
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    result["model_id"] = model_id_
    table = markdown_table(result, model_id_)
    if cfg.output_json:
        write_text_atomic(Path(cfg.output_json), json.dumps(result, indent=2) + "\n")
    if cfg.output_md:
        write_text_atomic(Path(cfg.output_md), table)
    sys.stdout.write(table)
    sys.stdout.write(json.dumps(result) + "\n")


add_show_config(app, EvalConfig)

if __name__ == "__main__":
    app()
