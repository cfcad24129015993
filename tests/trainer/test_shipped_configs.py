"""The configs users run train the trainers' default GRAFT: every trainer config in configs/ (but the demo's, whose
settings are its evidence runs' own: docs/demo.md), docker-compose's trainers, and the command and YAML blocks of
README.md and docs/ leave GRAFT's formula fields (`GRAFT_FORMULA_FIELDS`) at the trainers' default, or name a preset
(`graft.preset`) with a comment on its line saying why. `graft-train show-config` says which GRAFT a config runs."""

from __future__ import annotations

import itertools
import json
import re
import shlex
from pathlib import Path

import yaml
from typer.testing import CliRunner

from graft.trainer.cli import app
from graft.trainer.config import GRAFT_FORMULA_FIELDS, GraftOptions, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAMED = {*GRAFT_FORMULA_FIELDS, "preset"}  # what a config may set of GRAFT's maths: the fields, or a preset


def _trainer_configs() -> list[Path]:
    """configs/*.yaml that are graft-train configs (a `method`, every key a TrainConfig field), the demo's left out."""
    found = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if not path.name.startswith("demo_") and "method" in data and set(data) <= set(TrainConfig.model_fields):
            found.append(path)
    return found


def _graft_section(path: Path) -> dict:
    return dict((yaml.safe_load(path.read_text()) or {}).get("graft") or {})


def _departures(graft: dict) -> dict:
    return GraftOptions.model_validate(graft).departures()


def _overrides(args: list[str]) -> dict:
    """The graft section's fields a command line sets: graft-train's `--set graft.X=V`, verl's `+graft.options.X=V`,
    TRL's `graft_options={...}` (JSON)."""
    found = {}
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--set" and i + 1 < len(args) else arg
        match = re.fullmatch(r"\+?graft\.(?:options\.)?(\w+)=(.*)", value)
        if match and match.group(1) in NAMED:
            found[match.group(1)] = yaml.safe_load(match.group(2))
        options = re.fullmatch(r"--?graft_options[= ](.*)", value)
        if options:
            found.update({k: v for k, v in json.loads(options.group(1)).items() if k in NAMED})
    return found


def _config_of(args: list[str]) -> dict:
    """The graft section of the config a graft-train command line names (--config), if any."""
    for flag, value in itertools.pairwise(args):
        if flag in ("--config", "-c"):
            path = ROOT / value.lstrip("/")  # the compose files mount configs/ at /configs
            return _graft_section(path) if path.is_file() else {}
    return {}


def test_every_shipped_trainer_config_runs_the_default_graft_or_names_a_preset_and_says_why():
    configs = _trainer_configs()
    assert {"train.yaml", "train_toy.yaml", "train_cotrain.yaml", "compose_cpu_train.yaml"} <= {p.name for p in configs}
    for path in configs:
        graft = _graft_section(path)
        assert set(graft) & NAMED <= {"preset"}, (
            f"{path.name} sets {sorted(set(graft) & NAMED - {'preset'})}: a shipped config runs the trainers' default "
            "GRAFT, or names a preset (graft.preset) and says why")
        if "preset" in graft:
            line = next(line for line in path.read_text().splitlines() if line.strip().startswith("preset:"))
            assert "#" in line, f"{path.name} names graft.preset {graft['preset']} without saying why (a comment)"


def test_the_compose_trainers_run_the_configs_they_name_as_they_are():
    trainers = 0
    for compose in sorted(ROOT.glob("docker-compose*.yml")):
        for name, service in (yaml.safe_load(compose.read_text()).get("services") or {}).items():
            command = service.get("command") or []
            args = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
            if not ("graft.trainer.cli" in args or "graft-train" in args) or "train" not in args:
                continue
            trainers += 1
            graft = {**_config_of(args), **_overrides(args)}
            assert not _departures(graft) and "preset" not in graft, (
                f"{compose.name} service {name} trains with {_departures(graft)}: the compose trainers run the "
                "trainers' default GRAFT")
    assert trainers >= 6


def _blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of each fenced bash or yaml block of `page`."""
    return re.findall(r"```(bash|yaml)\n(.*?)```", page.read_text(), flags=re.DOTALL)


def test_the_docs_blocks_run_the_default_graft_or_name_a_preset_and_say_why():
    commands = 0
    for page in DOCS:
        for language, code in _blocks(page):
            if language == "yaml":
                graft = (yaml.safe_load(code) or {}).get("graft") if code.lstrip().startswith("graft") else None
                assert not graft or set(graft) & NAMED <= {"preset"}, f"{page.name}: a YAML block sets {graft}"
                continue
            for line in code.replace("\\\n", " ").splitlines():
                if "graft" not in line:
                    continue
                command, _, comment = line.partition(" #")
                args = shlex.split(command, comments=False) if command.strip() else []
                overrides = _overrides(args)
                commands += bool(overrides)
                graft = {**_config_of(args), **overrides}
                if "preset" in overrides:
                    assert comment.strip(), f"{page.name}: {line.strip()!r} names a preset without saying why"
                    assert set(overrides) == {"preset"}, f"{page.name}: {line.strip()!r} sets fields beside the preset"
                else:
                    assert not _departures(graft), f"{page.name}: {line.strip()!r} trains with {_departures(graft)}"
    assert commands >= 1  # docs/training.md's line that runs the `spec` preset's formulas, on purpose


def test_show_config_says_which_graft_a_config_runs():
    runner = CliRunner()
    said = {}
    for sets in ([], ["--set", "graft.preset=spec"], ["--set", "graft.token_is=tis"], ["--set", "method=grpo"]):
        result = runner.invoke(app, ["show-config", "--config", str(CONFIGS / "train.yaml"), *sets])
        assert result.exit_code == 0, result.output
        said[" ".join(sets)] = result.output.strip().splitlines()[-1]
    assert said[""].startswith("# GRAFT: the trainers' default GRAFT (token_is none, is_cap 2.0, kappa 1.0, log_rho_min None, "
                               "peer_negative_scale 0.0")
    assert said["--set graft.preset=spec"].startswith("# GRAFT: the `spec` preset's formulas as written (graft.preset spec)")
    assert said["--set graft.token_is=tis"] == "# GRAFT: not the trainers' default GRAFT: token_is tis (default none)"
    assert said["--set method=grpo"] == "# method grpo: no grafting, the graft section is unused"
