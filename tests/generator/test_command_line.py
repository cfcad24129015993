"""One command-line style for graft-train, graft-generate and graft-eval, implemented once (graft.schemas.overrides):
the config as `--config PATH`, a few named flags, `--set field=value` over the validated config, `show-config`; the
hidden per-field flags of earlier releases are gone (`--set` names every field)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from graft.schemas.overrides import load_config
from graft.services.generator.cli import app as generate_app
from graft.services.generator.config import GeneratorConfig, RescoreConfig
from graft.services.generator.eval_cli import app as eval_app
from graft.services.generator.import_cli import app as import_app
from graft.services.generator.rescore_cli import app as rescore_app

REPO_ROOT = Path(__file__).resolve().parents[2]


def _dry_run(*args: str) -> dict:
    """graft-generate's resolved config for a command line (its --dry-run), in this process."""
    result = CliRunner().invoke(generate_app, ["--model", "m", "--dataset", "d", "--store", "s", *args, "--dry-run",
                                               "--skip-path-check"])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)


def test_the_per_field_flags_of_earlier_releases_are_gone_and_set_reads_every_field():
    cfg = _dry_run("--set", "group_size=4", "--set", "top_p=0.9", "--set", "progress=false", "--set", "prompt.template=plain",
                   "--set", "prompt.instruction=''")
    assert (cfg["group_size"], cfg["top_p"], cfg["progress"], cfg["prompt"]["template"]) == (4, 0.9, False, "plain")
    assert cfg["prompt"]["instruction"] == ""  # an empty instruction; not "no value"
    for old in (["--group-size", "4"], ["--no-progress"]):
        result = CliRunner().invoke(generate_app, ["--model", "m", "--dataset", "d", "--store", "s", *old, "--dry-run",
                                                   "--skip-path-check"])
        assert result.exit_code == 2 and f"No such option: {old[0]}" in result.output, result.output


@pytest.mark.parametrize("args, message", [
    (["--group-sise", "4"], "No such option: --group-sise"),
    (["--set", "group_size=x"], "group_size: Input should be a valid integer"),
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
    cfg = load_config(GeneratorConfig, config, ["group_size=3", "top_k=null"], {"group_size": "6"})
    assert (cfg.group_size, cfg.top_k) == (3, None)
    assert load_config(GeneratorConfig, config, [], {"group_size": 6, "top_k": None}).group_size == 6  # a flag not given
    with pytest.raises(ValueError, match="group_size"):
        load_config(GeneratorConfig, config, ["group_size=0"])


@pytest.mark.parametrize("command, old, new", [
    (generate_app, "template=raw", "prompt.template"), (generate_app, "score_workers=1", "scoring.workers"),
    (generate_app, "hf_batch_size=8", "sampler.batch_size"), (generate_app, "backend=vllm", "sampler.backend"),
    (generate_app, "openai.base_url=http://h:1", "the sampler section (sampler.backend openai"),
    (generate_app, "vllm_max_model_len=2048", "sampler.max_model_len"),
    (eval_app, "few_shot=3", "prompt.few_shot"), (eval_app, "dtype=bfloat16", "sampler.dtype"),
    (import_app, "score_workers=1", "scoring.workers"), (import_app, "score_timeout_s=9", "scoring.timeout_s"),
    (rescore_app, "template=raw", "prompt.template"), (rescore_app, "system_prompt=Be brief.", "prompt.system_prompt"),
    (rescore_app, "backend=openai", "sampler.backend"), (rescore_app, "dtype=bfloat16", "sampler.dtype"),
    (rescore_app, "openai.base_url=http://h:1", "the sampler section (sampler.backend openai"),
])
def test_the_flat_keys_of_earlier_releases_are_refused_naming_the_new_one(command, old, new):
    """Issue 59: the prompt, sampler and scoring settings are sections now; an old key (a config file's, a --set's)
    fails in one line that names the key that replaced it, before anything loads."""
    flags = {generate_app: ["--model", "m", "--store", "s", "--dataset", "d", "--dry-run", "--skip-path-check"],
             eval_app: ["--model", "m"], import_app: ["--file", "f", "--model-id", "m", "--tokenizer", "t", "--store", "s"],
             rescore_app: ["--store", "s", "--source-model", "m", "--model", "p"]}[command]
    result = CliRunner().invoke(command, [*flags, "--set", old])
    assert result.exit_code == 2 and f"{old.split('=')[0].split('.')[0]}: now {new}" in result.output, result.output
    assert "Traceback" not in result.output


def test_backend_replaces_the_configs_sampler_section_and_takes_its_own_settings_only(tmp_path):
    """A backend takes its own settings: a config's hf batch size would do nothing under vllm, so --backend replaces the
    section (as graft-train's --peers replaces peers), and a setting of another backend is refused, naming the
    backend's own."""
    config = tmp_path / "gen.yaml"
    config.write_text("model: m\ndataset: d\nstore: s\nsampler:\n  backend: hf\n  batch_size: 8\n")
    kept = load_config(GeneratorConfig, config)
    assert (kept.sampler.backend, kept.sampler.batch_size) == ("hf", 8)
    swapped = load_config(GeneratorConfig, config, ["sampler.max_model_len=2048"], {"sampler": {"backend": "vllm"}})
    assert swapped.sampler.model_dump() == {"backend": "vllm", "dtype": "float32", "max_model_len": 2048,
                                            "gpu_memory_utilization": None}
    with pytest.raises(ValueError, match="sampler.batch_size with sampler.backend vllm: not a setting of that backend "
                                         r"\(it takes dtype, gpu_memory_utilization, max_model_len\)"):
        load_config(GeneratorConfig, config, ["sampler.backend=vllm"])


def test_graft_rescore_takes_the_sampler_section_of_what_teacher_forces_and_nothing_that_only_samples():
    """graft-rescore's weights are the sampler section's (hf in this process, openai a server's prompt_logprobs):
    --backend replaces it as graft-generate's does; vllm has no teacher forcing here, and a setting read only when
    sampling (hf's batch size, a server's logprobs mode) would do nothing: each refused in one line."""
    base = {"store": "s", "source_model": "m", "model": "p"}
    served = load_config(RescoreConfig, None, ["sampler.base_url=http://h:1", "prompt.template=raw"],
                         {**base, "sampler": {"backend": "openai"}})
    assert (served.sampler.backend, served.sampler.base_url, served.prompt.template) == ("openai", "http://h:1", "raw")
    assert load_config(RescoreConfig, None, ["sampler.dtype=bfloat16"], base).sampler.dtype == "bfloat16"
    for sets, message in ((["sampler.backend=vllm"], r"sampler.backend: one of hf, openai \(graft-rescore "
                                                     "teacher-forces in this process, or through a vLLM server's"),
                          (["sampler.batch_size=8"], "sampler.batch_size: read only when sampling"),
                          (["sampler.backend=openai", "sampler.base_url=http://h:1", "sampler.logprobs_mode=raw_logprobs"],
                           "sampler.logprobs_mode: read only when sampling")):
        with pytest.raises(ValueError, match=message):
            load_config(RescoreConfig, None, sets, base)


def test_the_resume_key_of_earlier_releases_stands():
    """Group ids hold the sampling key: the same settings written as sections make the key the flat fields made (the
    value a release before the sections gave these settings), so a store of an earlier run resumes."""
    base = {"model": "m", "dataset": "d", "store": "s"}
    assert GeneratorConfig(**base, prompt={"template": "raw"}, group_size=4, temperature=0.7).sampling_key() == \
        "b0bc9372d4d4"
    assert GeneratorConfig(**base, sampler={"backend": "openai", "base_url": "http://h",
                                            "logprobs_mode": "raw_logprobs"}).sampling_key() == "67f6c5e6284b"


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


def test_one_config_reader_and_no_rewritten_signatures():
    """Issue 51: one `load_config` (graft.schemas.overrides) reads the three commands' configs; no command's options are
    made by rewriting a function's `__signature__` (the hidden flags of earlier releases were)."""
    import ast

    defined, rewritten = [], []
    for folder in ("src/graft", "demo", "benchmarks", "gpu_check"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            text = path.read_text()
            tree = ast.parse(text)
            defined += [str(path.relative_to(REPO_ROOT)) for node in ast.walk(tree)
                        if isinstance(node, ast.FunctionDef) and node.name == "load_config"]
            rewritten += [str(path.relative_to(REPO_ROOT)) for node in ast.walk(tree)
                          if isinstance(node, ast.Attribute) and node.attr == "__signature__"]
    assert defined == ["src/graft/schemas/overrides.py"] and rewritten == []


@pytest.mark.parametrize("command, config, field", [
    (["graft.services.generator.cli", "--model", "m", "--dataset", "d", "--store", "s", "--dry-run", "--skip-path-check"],
     "group_size: 7\n", "group_size"),
    (["graft.trainer.cli", "train", "--dry-run", "--skip-path-check"],
     "model: {path: m}\ndata: {dataset: d}\nmethod: grpo\nsteps: 7\n", "steps"),
    (["graft.services.generator.eval_cli", "show-config", "--set", "model=m"], "k: 7\n", "k"),
])
def test_every_command_takes_its_config_as_dash_dash_config(command, config, field, tmp_path):
    """One way to pass a config: `--config PATH` for graft-generate, graft-train and graft-eval (which has no dry run:
    its show-config resolves the config)."""
    path = tmp_path / "c.yaml"
    path.write_text(config)
    run = _cli(*command, "--config", str(path))
    assert run.returncode == 0, run.stderr
    resolved = run.stdout.split("# resolved\n", 1)[-1]
    assert yaml.safe_load(resolved)[field] == 7


def test_graft_trains_positional_config_still_runs_and_says_it_is_deprecated(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: {path: m}\ndata: {dataset: d}\nmethod: grpo\nsteps: 7\n")
    run = _cli("graft.trainer.cli", "train", str(config), "--dry-run", "--skip-path-check")
    assert run.returncode == 0 and yaml.safe_load(run.stdout)["steps"] == 7, run.stderr
    assert f"deprecated: write `graft-train train --config {config}`" in run.stderr
    both = _cli("graft.trainer.cli", "train", str(config), "--config", str(config), "--dry-run", "--skip-path-check")
    assert both.returncode == 2 and "give --config only" in both.stderr
