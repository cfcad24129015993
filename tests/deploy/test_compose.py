"""docker-compose.yml: every service runs a real entry point of this project with a valid configuration.

No Docker engine runs here, so the commands are resolved the way the containers would run them:
the entry point must be a console script of pyproject.toml, and the arguments (with the mounted
/configs read from ./configs) must pass the command's own validation (`--dry-run`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _local_args(command: list[str]) -> list[str]:
    """Container paths of the mounted configs -> this checkout's configs/."""
    return [arg.replace("/configs/", str(ROOT / "configs") + "/") for arg in command[1:]]


def _app(entry_point: str):
    module_name, attr = SCRIPTS[entry_point].split(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)


@pytest.mark.parametrize("service", sorted(COMPOSE["services"]))
def test_service_command_is_a_valid_entry_point(service: str) -> None:
    command = COMPOSE["services"][service]["command"]
    assert command[0] in SCRIPTS, f"{service}: {command[0]} is not a console script of pyproject.toml"
    args = _local_args(command)
    if command[0] == "graft-store":
        assert args[0] == "serve"
        from services.store_api.settings import StoreSettings

        pairs = dict(zip(args[1::2], args[2::2]))
        settings = StoreSettings(root=pairs["--root"], host=pairs["--host"], port=int(pairs["--port"]))
        assert settings.port == 8600 and settings.host == "0.0.0.0"
        return
    result = CliRunner().invoke(_app(command[0]), [*args, "--dry-run"])
    assert result.exit_code == 0, f"{service}: {' '.join(command)} fails validation:\n{result.output}"
    resolved = yaml.safe_load(result.output)
    assert isinstance(resolved, dict) and resolved, f"{service}: --dry-run printed no configuration"


def _option(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_every_grafting_trainer_has_its_peers_tokenizer() -> None:
    """A trainer refuses peer groups whose tokenizer it lacks: each compose trainer that grafts must get the
    tokenizer of every model it takes groups from (the generator's or its co-trainer's `--model`), at a path
    inside a volume mounted into its container."""
    services = COMPOSE["services"]
    samplers = {name: _option(s["command"], "--model") for name, s in services.items() if _option(s["command"], "--model")}
    trainers = [name for name, s in services.items() if s["command"][0] == "graft-train"]
    assert trainers
    for name in trainers:
        service = services[name]
        result = CliRunner().invoke(_app("graft-train"), [*_local_args(service["command"]), "--dry-run"])
        assert result.exit_code == 0, result.output
        resolved = yaml.safe_load(result.output)
        if resolved["method"] != "graft":
            continue
        # the models it grafts from: the other samplers started with it (same compose profiles)
        peers = {model for other, model in samplers.items()
                 if other != name and model != samplers[name] and services[other].get("profiles") == service.get("profiles")}
        assert peers, f"{name}: no peer model found in the compose file"
        configured = resolved["graft"]["peer_tokenizers"]
        paths = set(configured.values() if isinstance(configured, dict) else configured)
        assert peers <= paths, f"{name}: graft.peer_tokenizers {sorted(paths)} lacks its peers' {sorted(peers - paths)}"
        # SOURCE:TARGET[:MODE], where SOURCE may be ${VAR:-default}
        mounts = [re.sub(r"\$\{[^}]*\}", "source", volume).split(":")[1] for volume in service["volumes"]]
        for path in paths:
            assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (
                f"{name}: peer tokenizer {path} is not inside a mounted volume ({mounts})")


def test_gpu_services_reserve_a_gpu_and_store_has_healthcheck() -> None:
    services = COMPOSE["services"]
    assert "healthcheck" in services["store"]
    for name, service in services.items():
        if name == "store":
            continue
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia", name
        assert service["depends_on"]["store"]["condition"] == "service_healthy", name


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose client not installed (CI installs it)")
def test_docker_compose_config_is_valid() -> None:
    subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], check=True, cwd=ROOT)
