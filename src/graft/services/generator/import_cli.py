"""`graft-import`: text-only traces (a JSONL/Parquet file, a published trace set, TRL's completions, verl's rollout
dump) into stored groups.

    graft-import --format trl --file runs/trl --problems data.jsonl --model-id peer --tokenizer models/peer \\
        --store stores/local --set max_tokens=256 --set eval_problems=eval.jsonl
    graft-import --file traces.jsonl --model-id r1 --tokenizer models/peer --store stores/local \\
        --set completion_column=completions --set gold_column=solution --set finish_reason=stop
    graft-import show-config    # every field, its default and its doc line

The rows have no behaviour logprobs (logprobs_mode 'none'): the trainers graft them with b = 1 and w = 1;
`graft-rescore` fills in mu from the peer's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from graft.schemas.overrides import add_show_config, command_line_config
from graft.services.generator.config import ImportConfig, print_summary

app = typer.Typer(add_completion=False, invoke_without_command=True, help=__doc__)


def _help(name: str) -> str:
    return ImportConfig.model_fields[name].description or ""


@app.callback()
def import_traces(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML file with ImportConfig fields; flags and --set override it"),
    file: list[str] = typer.Option([], "--file", "-f", help="a trace file or a folder of them (repeatable): " + _help("files")),
    format: Optional[str] = typer.Option(None, "--format", help=_help("format")),
    model_id: Optional[str] = typer.Option(None, help=_help("model_id")),
    tokenizer: Optional[str] = typer.Option(None, help=_help("tokenizer")),
    problems: Optional[str] = typer.Option(None, help=_help("problems")),
    store: Optional[str] = typer.Option(None, help=_help("store")),
    store_token: Optional[str] = typer.Option(None, envvar="GRAFT_STORE_TOKEN", help=_help("store_token")),
    sets: list[str] = typer.Option([], "--set", help="any field as field=value, e.g. --set reward_column=score "
                                   "(repeatable; `graft-import show-config` lists them)"),
    summary_json: Optional[Path] = typer.Option(None, help="also write the JSON summary to this file (whole or not at all)"),
) -> None:
    """Import text-only traces as whole groups without behaviour logprobs; a re-import skips what is stored.

    Each row that cannot be imported is one line on stderr (file, row, reason), its group left out, and counted in
    the summary (stdout's last line, JSON); what the import notices (how many prompts matched, the run's rewards
    disagreeing with math-verify) is a `note:` line. A file that cannot be read or lacks a named column, prompts
    matching no problem, or a run whose completions' ends cannot be told stops the import before anything is stored.
    """
    if ctx.invoked_subcommand:  # show-config
        return
    named = {"files": file or None, "format": format, "model_id": model_id, "tokenizer": tokenizer,
             "problems": problems, "store": store, "store_token": store_token}
    cfg = command_line_config(ImportConfig, config, sets, named)

    from graft.rollouts.traces import TraceFileError
    from graft.services.generator.importing import run_import

    def bad_row(line: str) -> None:
        typer.echo(f"bad row: {line}", err=True)

    def note(line: str) -> None:
        typer.echo(f"note: {line}", err=True)

    try:
        stats = run_import(cfg, on_bad_row=bad_row, on_note=note)
    except (TraceFileError, FileNotFoundError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    summary = stats.summary(cfg.max_disagreement)
    print_summary(summary, summary_json)


add_show_config(app, ImportConfig)

if __name__ == "__main__":
    app()
