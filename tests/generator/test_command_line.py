"""One command-line style for graft-train, graft-generate and graft-eval (schemas/overrides.py): a few named flags,
`--set field=value` over the validated config, `show-config`; the per-field flags of earlier releases still read
(hidden options of the field's type, so typer parses and refuses them as it does the named ones)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from graft.services.generator.cli import app as generate_app
from graft.services.generator.config import GeneratorConfig, load_config
from graft.services.generator.eval_cli import app as eval_app

REPO_ROOT = Path(__file__).resolve().parents[2]


def _dry_run(*args: str) -> dict:
    """graft-generate's resolved config for a command line (its --dry-run), in this process."""
    result = CliRunner().invoke(generate_app, ["--model", "m", "--dataset", "d", "--store", "s", *args, "--dry-run",
                                               "--skip-path-check"])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)


def test_old_per_field_flags_read_as_the_fields_they_name():
    cfg = _dry_run("--group-size", "4", "--top-p=0.9", "--no-progress", "--template", "plain", "--instruction", "")
    assert (cfg["group_size"], cfg["top_p"], cfg["progress"], cfg["template"]) == (4, 0.9, False, "plain")
    assert cfg["instruction"] == ""  # an empty instruction, as the old flag meant; not "no value"
    assert _dry_run("--group-size", "4", "--set", "group_size=2")["group_size"] == 2  # --set comes last and wins


@pytest.mark.parametrize("args, message", [
    (["--group-sise", "4"], "No such option: --group-sise"),
    (["--top-k"], "--top-k"),
    (["--group-size", "x"], "Invalid value for '--group-size'"),
    (["--set", "group_size=0"], "group_size: Input should be greater than or equal to 1"),
])
def test_a_flag_that_names_no_field_or_a_bad_value_is_refused(args, message):
    result = CliRunner().invoke(generate_app, ["--model", "m", "--dataset", "d", "--store", "s", *args, "--dry-run",
                                               "--skip-path-check"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_follow_wanted_needs_continuous_mode_and_a_store_server():
    cfg = _dry_run("--store", "http://127.0.0.1:1", "--set", "continuous=true", "--set", "follow_wanted=true",
                   "--set", "wanted_order=most_wanted")
    assert (cfg["follow_wanted"], cfg["wanted_order"]) == (True, "most_wanted")
    for args in (["--set", "follow_wanted=true", "--store", "http://127.0.0.1:1"],  # one pass: nothing to follow
                 ["--set", "follow_wanted=true", "--set", "continuous=true"],  # a store root: no server to ask
                 ["--set", "wanted_order=most_wanted"]):  # an order of nothing
        result = CliRunner().invoke(generate_app, ["--model", "m", "--dataset", "d", "--store", "s", *args, "--dry-run",
                                                   "--skip-path-check"])
        assert result.exit_code == 2 and ("follow_wanted" in result.output), result.output


def test_set_wins_over_flags_and_the_file(tmp_path):
    config = tmp_path / "gen.yaml"
    config.write_text("model: m\ndataset: d\nstore: s\ngroup_size: 8\n")
    cfg = load_config(GeneratorConfig, config, {"group_size": "6"}, ["group_size=3", "top_k=null"])
    assert (cfg.group_size, cfg.top_k) == (3, None)
    with pytest.raises(ValueError, match="group_size"):
        load_config(GeneratorConfig, config, {}, ["group_size=0"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module, field", [("graft.services.generator.cli", "prompts_per_batch"),
                                           ("graft.services.generator.eval_cli", "output_md"),
                                           ("graft.trainer.cli", "graft.peer_negative_scale")])
def test_show_config_lists_every_field_the_same_way(module, field):
    shown = _cli(module, "show-config")
    assert shown.returncode == 0, shown.stderr
    assert any(line.split()[0] == field for line in shown.stdout.splitlines() if line.strip())


def test_show_config_resolves_a_config_with_set():
    shown = _cli("graft.services.generator.cli", "show-config", "--config", "configs/generator_cpu.yaml", "--set", "group_size=3")
    assert shown.returncode == 0, shown.stderr
    assert "# resolved" in shown.stdout and "\ngroup_size: 3\n" in shown.stdout
    bad = _cli("graft.services.generator.cli", "show-config", "--config", "configs/generator_cpu.yaml", "--set", "group_size=x")
    assert bad.returncode == 2 and "group_size" in bad.stderr and "Traceback" not in bad.stderr


def test_eval_refuses_an_unknown_flag_before_loading_anything(tmp_path):
    result = CliRunner().invoke(eval_app, ["--model", str(tmp_path), "--max-tokenz", "5"])
    assert result.exit_code == 2 and "No such option: --max-tokenz" in result.output
