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


def _entry_point(command: list[str]) -> list[str]:
    """The console script a service runs and its arguments, as the container would resolve them: a compose variable
    takes its default (`${GRAFT_TRAINER_GPUS:-1}` -> 1), and `torchrun ... -m trainer.cli ARGS` is graft-train ARGS on
    each rank."""
    command = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg) for arg in command]
    if command[0] == "torchrun":
        module = command.index("-m")
        assert command[module + 1] == "trainer.cli", command
        return ["graft-train", *command[module + 2 :]]
    return command


def _local_args(command: list[str]) -> list[str]:
    """Container paths of the mounted configs -> this checkout's configs/."""
    return [arg.replace("/configs/", str(ROOT / "configs") + "/") for arg in _entry_point(command)[1:]]


def _app(entry_point: str):
    module_name, attr = SCRIPTS[entry_point].split(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)


# services of other projects' images: the lake profile's PostgreSQL catalog, MinIO and its one-shot bucket maker
INFRASTRUCTURE = {name for name, service in COMPOSE["services"].items() if not service["image"].startswith("graft:")}
GRAFT_SERVICES = sorted(set(COMPOSE["services"]) - INFRASTRUCTURE)
CPU_SERVICES = {name for name in GRAFT_SERVICES if COMPOSE["services"][name]["image"] == "graft:cpu"}


@pytest.mark.parametrize("service", GRAFT_SERVICES)
def test_service_command_is_a_valid_entry_point(service: str) -> None:
    command = _entry_point(COMPOSE["services"][service]["command"])
    assert command[0] in SCRIPTS, f"{service}: {command[0]} is not a console script of pyproject.toml"
    args = _local_args(command)
    if command[0] == "graft-store":
        assert args[0] == "serve"
        from services.store_api.settings import StoreSettings

        pairs = {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(args[1::2], args[2::2])}
        settings = StoreSettings(**pairs)  # every flag is a StoreSettings field, and their values validate
        assert settings.port == 8600 and settings.host == "0.0.0.0"
        if settings.backend == "lake":
            from services.store_api.lake import LakeConfig

            environment = COMPOSE["services"][service]["environment"]
            assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "PGPASSWORD"} <= set(environment)
            assert LakeConfig(catalog=settings.lake_catalog).kind == "postgres"
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
    samplers = {name: _option(services[name]["command"], "--model") for name in GRAFT_SERVICES
                if _option(services[name]["command"], "--model")}
    trainers = [name for name in GRAFT_SERVICES if _entry_point(services[name]["command"])[0] == "graft-train"]
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


def test_gpu_services_reserve_a_gpu_and_stores_have_healthchecks() -> None:
    services = COMPOSE["services"]
    for name in CPU_SERVICES:
        assert "healthcheck" in services[name], name
    for name in set(GRAFT_SERVICES) - CPU_SERVICES:
        service = services[name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia", name
        waits_for = service["depends_on"]
        assert any(dependency in CPU_SERVICES | {"lake-catalog"} for dependency in waits_for), name
        assert all(condition["condition"] in ("service_healthy", "service_completed_successfully")
                   for condition in waits_for.values()), name


def test_trainers_run_one_rank_per_reserved_gpu() -> None:
    """Every trainer is `torchrun --nproc-per-node ${GRAFT_TRAINER_GPUS:-1} -m trainer.cli train ...` on as many reserved
    GPUs, data parallel (a strategy other than none: ranks launched with none are refused)."""
    services = COMPOSE["services"]
    trainers = [name for name in GRAFT_SERVICES if _entry_point(services[name]["command"])[0] == "graft-train"]
    assert {"trainer", "cotrain-learner", "cotrain-peer", "lake-trainer"} <= set(trainers)
    for name in trainers:
        command = services[name]["command"]
        assert command[0] == "torchrun" and _option(command, "--nproc-per-node") == "${GRAFT_TRAINER_GPUS:-1}", name
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["count"] == "${GRAFT_TRAINER_GPUS:-1}", name
        result = CliRunner().invoke(_app("graft-train"), [*_local_args(command), "--dry-run"])
        assert yaml.safe_load(result.output)["parallel"]["strategy"] in ("ddp", "fsdp"), name


def test_lake_profile_services() -> None:
    services = COMPOSE["services"]
    lake = {name for name, service in services.items() if "lake" in service.get("profiles", [])}
    assert INFRASTRUCTURE <= lake and {"lake-replica-1", "lake-replica-2", "lake-generator", "lake-trainer"} <= lake
    assert services["lake-catalog"]["image"].startswith("postgres:") and "healthcheck" in services["lake-catalog"]
    assert services["lake-s3"]["image"].startswith("minio/minio") and "healthcheck" in services["lake-s3"]
    generator = services["lake-generator"]["command"]
    assert generator[generator.index("--store") + 1].startswith("ducklake:postgres:")
    assert services["lake-trainer"]["command"][services["lake-trainer"]["command"].index("--store-url") + 1] == \
        "http://lake-replica-1:8600"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose client not installed (make test installs it)")
def test_docker_compose_config_is_valid() -> None:
    subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], check=True, cwd=ROOT)


def test_datasets_mount_is_the_repositorys_data_and_holds_what_the_services_read(monkeypatch) -> None:
    """The CUDA services read data sets from /datasets (GRAFT_DATA_DIR); by default that is ./data of this
    checkout, and every data set their configs name is in it."""
    image = COMPOSE["x-cuda-image"]
    mount = next(v for v in image["volumes"] if v.endswith(":/datasets:ro"))
    source = mount.removesuffix(":/datasets:ro")
    default = source.split(":-", 1)[1].rstrip("}") if source.startswith("${") else source
    assert default == "./data" and image["environment"]["GRAFT_DATA_DIR"] == "/datasets"
    monkeypatch.setenv("GRAFT_DATA_DIR", str(ROOT / default))
    from rollouts.datasets import load_problems

    for service in COMPOSE["services"].values():
        configs = [ROOT / a.replace("/configs/", "configs/") for a in service.get("command", []) if a.startswith("/configs/")]
        for config in configs:
            cfg = yaml.safe_load(config.read_text())
            names = [cfg["dataset"]] if "dataset" in cfg else [cfg["data"]["dataset"], *cfg.get("eval", {}).get("benchmarks", {}).values()]
            for name in names:
                assert load_problems(name, limit=1), f"{config.name} names {name!r}, absent from {default}"
