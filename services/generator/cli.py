"""`graft-generate`: fill a store with scored rollout groups (YAML config, flags on top)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from services.generator.config import GeneratorConfig, load_config

app = typer.Typer(add_completion=False, help=__doc__)


def _help(name: str) -> str:
    return GeneratorConfig.model_fields[name].description or ""


@app.command()
def generate(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML file with GeneratorConfig fields; flags override it"),
    model: Optional[str] = typer.Option(None, help=_help("model")),
    model_id: Optional[str] = typer.Option(None, help=_help("model_id")),
    model_revision: Optional[str] = typer.Option(None, help=_help("model_revision")),
    backend: Optional[str] = typer.Option(None, help=_help("backend")),
    dataset: Optional[str] = typer.Option(None, help=_help("dataset")),
    dataset_limit: Optional[int] = typer.Option(None, help=_help("dataset_limit")),
    problem_field: Optional[str] = typer.Option(None, help=_help("problem_field")),
    answer_field: Optional[str] = typer.Option(None, help=_help("answer_field")),
    template: Optional[str] = typer.Option(None, help=_help("template")),
    few_shot: Optional[int] = typer.Option(None, help=_help("few_shot")),
    instruction: Optional[str] = typer.Option(None, help=_help("instruction")),
    system_prompt: Optional[str] = typer.Option(None, help=_help("system_prompt")),
    group_size: Optional[int] = typer.Option(None, help=_help("group_size")),
    temperature: Optional[float] = typer.Option(None, help=_help("temperature")),
    top_p: Optional[float] = typer.Option(None, help=_help("top_p")),
    top_k: Optional[int] = typer.Option(None, help=_help("top_k")),
    max_tokens: Optional[int] = typer.Option(None, help=_help("max_tokens")),
    seed: Optional[int] = typer.Option(None, help=_help("seed")),
    rounds: Optional[int] = typer.Option(None, help=_help("rounds")),
    prompts_per_batch: Optional[int] = typer.Option(None, help=_help("prompts_per_batch")),
    store: Optional[str] = typer.Option(None, help=_help("store")),
    store_token: Optional[str] = typer.Option(None, envvar="GRAFT_STORE_TOKEN", help=_help("store_token")),
    policy_step: Optional[int] = typer.Option(None, help=_help("policy_step")),
    generator_id: Optional[str] = typer.Option(None, help=_help("generator_id")),
    std_normalize: Optional[bool] = typer.Option(None, "--std-normalize/--no-std-normalize", help=_help("std_normalize")),
    score_workers: Optional[int] = typer.Option(None, help=_help("score_workers")),
    score_timeout_s: Optional[float] = typer.Option(None, help=_help("score_timeout_s")),
    dtype: Optional[str] = typer.Option(None, help=_help("dtype")),
    hf_batch_size: Optional[int] = typer.Option(None, help=_help("hf_batch_size")),
    vllm_max_model_len: Optional[int] = typer.Option(None, help=_help("vllm_max_model_len")),
    vllm_gpu_memory_utilization: Optional[float] = typer.Option(None, help=_help("vllm_gpu_memory_utilization")),
    continuous: Optional[bool] = typer.Option(None, "--continuous/--no-continuous", help=_help("continuous")),
    watch_dir: Optional[str] = typer.Option(None, help=_help("watch_dir")),
    max_batches: Optional[int] = typer.Option(None, help=_help("max_batches")),
    idle_sleep_s: Optional[float] = typer.Option(None, help=_help("idle_sleep_s")),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help=_help("progress")),
    dry_run: bool = typer.Option(False, "--dry-run", help="validate the configuration and its inputs (model, dataset and "
                                 "its columns), print it as YAML and the first problem's prompt as the model sees it, "
                                 "and exit"),
    skip_path_check: bool = typer.Option(False, "--skip-path-check", help="do not check the model and dataset (they are "
                                         "another machine's, e.g. a container's mounts)"),
    summary_json: Optional[Path] = typer.Option(
        None, help="also write the run's JSON summary to this file (whole or not at all): stdout may carry an engine's logs"),
) -> None:
    """Sample groups for every prompt of a dataset, score them with math-verify, and store them.

    A restarted run skips the groups already stored for this model and revision. SIGTERM stops
    it cleanly after the current batch is stored. In continuous mode a store that is down is
    tried again with a growing pause (up to a minute), the sampled batch kept meanwhile.
    """
    overrides = {k: v for k, v in locals().items() if k not in ("config", "dry_run", "summary_json", "skip_path_check")}
    try:
        cfg = load_config(GeneratorConfig, config, overrides)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    missing = [] if skip_path_check else cfg.missing_inputs()
    if missing:
        typer.echo("error: the configuration names inputs that are not there or cannot be read:\n"
                   + "\n".join(f"  {m}" for m in missing), err=True)
        raise typer.Exit(2)
    if dry_run:
        import yaml

        typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        if not skip_path_check:
            _show_first_prompt(cfg)
        return

    from services.generator.generate import OtherSettingsStored, run_generator

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        stats = run_generator(cfg)
    except OtherSettingsStored as e:  # a refusal to say in one line, not a crash
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    summary = {
        "groups": stats.groups,
        "rollouts": stats.rollouts,
        "skipped_already_stored": stats.skipped_already_stored,
        "batches": stats.batches,
        "reloads": stats.reloads,
        "store_retries": stats.store_retries,
        "success_rate": stats.correct / stats.scored if stats.scored else None,
        # why the rate is what it is: the scorer reads only the last \boxed{} answer, and a cut answer has none
        "no_boxed_answer": stats.no_boxed_answer,
        "truncated": stats.truncated,
        "gold_unparsed": stats.gold_unparsed,
        "completion_tokens": stats.completion_tokens,
        "tokens_per_s": stats.completion_tokens / stats.sampling_s if stats.sampling_s else None,
        "outside_sampling_share": stats.outside_sampling_share,
        "wall_s": round(stats.wall_s, 3),
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    if summary_json is not None:
        from rollouts.files import write_text_atomic

        write_text_atomic(summary_json, json.dumps(summary) + "\n")


def _show_first_prompt(cfg: GeneratorConfig) -> None:
    """The first problem's prompt as the model sees it (the tokenizer's chat template applied), and its gold."""
    from rollouts.datasets import load_problems
    from rollouts.models import load_tokenizer_of
    from services.generator.generate import render_prompt

    problem = load_problems(cfg.dataset, limit=1, problem_field=cfg.problem_field, answer_field=cfg.answer_field)[0]
    prompt = render_prompt(cfg, load_tokenizer_of(cfg.model), problem.problem)
    typer.echo(f"# the first problem's prompt, as the model sees it (prompt_id {problem.prompt_id}):\n{prompt}")
    typer.echo(f"# its gold answer, as the scorer reads it: {problem.answer}")


if __name__ == "__main__":
    app()
