"""`graft-generate`: fill a store with scored rollout groups (a YAML config, named flags and `--set` on top).

    graft-generate --config configs/generator_cpu.yaml --model models/peer --model-id smollm2-peer --store stores/local
    graft-generate --config configs/generator_cpu.yaml --set group_size=4 --set max_tokens=256 ...
    graft-generate show-config --config configs/generator_cpu.yaml    # every field, its default and its doc line

Every GeneratorConfig field is `--set field=value` (the per-field flags of earlier releases, `--group-size 4`, are
gone: `--set group_size=4`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from graft.schemas.overrides import add_show_config, command_line_config
from graft.services.generator.config import GeneratorConfig, print_summary

app = typer.Typer(add_completion=False, invoke_without_command=True, help=__doc__)


def _help(name: str) -> str:
    return GeneratorConfig.model_fields[name].description or ""


@app.callback()
def generate(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML file with GeneratorConfig fields; flags and --set override it"),
    model: Optional[str] = typer.Option(None, help=_help("model")),
    model_id: Optional[str] = typer.Option(None, help=_help("model_id")),
    backend: Optional[str] = typer.Option(None, help="which backend samples (sampler.backend, the config's sampler section "
                                          "replaced: --set sampler.<setting> after it): hf (transformers), vllm, or "
                                          "openai (a completions server: --set sampler.base_url=...)"),
    dataset: Optional[str] = typer.Option(None, help=_help("dataset")),
    store: Optional[str] = typer.Option(None, help=_help("store")),
    store_token: Optional[str] = typer.Option(None, envvar="GRAFT_STORE_TOKEN", help=_help("store_token")),
    sets: list[str] = typer.Option([], "--set", help="any field as field=value, e.g. --set group_size=4 (repeatable; "
                                   "`graft-generate show-config` lists them)"),
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

    Any field: --set field=value (`graft-generate show-config` lists them).
    """
    named = {"model": model, "model_id": model_id, "dataset": dataset, "store": store, "store_token": store_token,
             # a backend takes its own settings: --backend replaces the config's sampler section
             "sampler": None if backend is None else {"backend": backend}}
    if ctx.invoked_subcommand:  # show-config
        return
    cfg = command_line_config(GeneratorConfig, config, sets, named)
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

    from graft.rollouts.openai_backend import ServerError
    from graft.services.generator.generate import OtherSettingsStored, run_generator

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        stats = run_generator(cfg)
    except (OtherSettingsStored, ServerError) as e:  # a refusal, or a served model's failure: one line, not a crash
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
    if stats.server is not None:  # backend openai: what was asked of the server
        summary["server"] = stats.server
    print_summary(summary, summary_json)


def _show_first_prompt(cfg: GeneratorConfig) -> None:
    """The first problem's prompt as the model sees it (the tokenizer's chat template applied), and its gold."""
    from graft.rollouts.datasets import load_problems
    from graft.rollouts.models import load_tokenizer_of

    problem = load_problems(cfg.dataset, limit=1, problem_field=cfg.problem_field, answer_field=cfg.answer_field)[0]
    prompt = cfg.prompt.render(load_tokenizer_of(cfg.model), problem.problem)
    typer.echo(f"# the first problem's prompt, as the model sees it (prompt_id {problem.prompt_id}):\n{prompt}")
    typer.echo(f"# its gold answer, as the scorer reads it: {problem.answer}")


add_show_config(app, GeneratorConfig)

if __name__ == "__main__":
    app()
