"""docker-compose.yml: every service runs a real entry point of this project with a valid configuration.

No Docker engine runs here, so the commands are resolved the way the containers would run them:
the entry point must be a console script of pyproject.toml, and the arguments (with the mounted
/configs read from ./configs) must pass the command's own validation (`--dry-run`)."""

from __future__ import annotations

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
