"""`docker-compose up` for real: the CPU form of every topology, built, started, checked and taken down.

An engine that answers (DOCKER_HOST or the default socket) is used; else, as root with dockerd installed, a private
one (tests/deploy/helpers/docker_engine.py); else the module skips with the reason, except under CI=true, where it fails. Per
topology: `up -d`, wait, check, `down -v`:
- the GPU default's one-shot `models` service, on an empty models folder: SmolLM2 laid out as learner and peer;
- default: the store turns healthy, the generator's groups grow /v1/stats through the published port, the trainer
  grafts (peer_hit_rate > 0, grafted groups > 0) and writes checkpoints, the browser page answers;
- faults (on the default topology): SIGKILL of the store's main process while the generator pushes and the trainer
  looks up (the restart policy brings it back, nothing it had counted is lost, the outage's steps run as GRPO and
  the trainer grafts again after); SIGKILL of the trainer (it continues from its newest checkpoint); then the
  generator, stopped, has stored exactly what the store holds, and plain DuckDB over manifest.json counts what
  /v1/stats counts;
- cotrain: both trainers publish and graft each other's groups; the generator of the peer's model reloads the peer
  trainer's newer checkpoints (its log says so, a line per reload; its summary counts them; the store holds its rows
  of the newer policy step);
- lake: PostgreSQL and an S3 server (moto's: where Docker Hub cannot be reached, both built on the test base image;
  users keep postgres:15 and MinIO), two replicas, a generator committing to the lake, a trainer reading replica 1;
  both replicas answer the same /v1/stats, and a replica killed and restarted catches up.

Wall times (image builds, each topology) are written to test-artifacts/deploy_times.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from docker_engine import (
    ROOT,
    Project,
    base_image,
    build_image,
    find_or_start_engine,
    http_json,
    wait_for,
)

CPU_FILE = ROOT / "docker-compose.cpu.yml"
GPU_FILE = ROOT / "docker-compose.yml"
OFFLINE_LAKE_FILE = Path(__file__).parent / "compose.offline-lake.yml"
IMAGES = Path(__file__).parent / "images"
TIMES: dict[str, float] = {}
COUNTS: dict[str, object] = {}  # what each topology did, for the closing note (written beside the times)
# each topology takes minutes (the default one's first start builds the toy models); on a busy machine many more
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine():
    engine, why = find_or_start_engine()
    if engine is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and no Docker engine: {why}")
        pytest.skip(why)
    yield engine
    out = ROOT / "test-artifacts"
    out.mkdir(exist_ok=True)
    (out / "deploy_times.json").write_text(json.dumps({"seconds": TIMES, "counts": COUNTS}, indent=2))
    print(f"deploy times (s): {json.dumps({k: round(v, 1) for k, v in TIMES.items()})}; counts: {json.dumps(COUNTS)}")
    engine.stop()


@pytest.fixture(scope="module")
def images(engine) -> dict[str, str]:
    """graft:cpu from docker/Dockerfile.cpu on the base this engine can have; returns the build args used."""
    started = time.perf_counter()
    base, build_args = base_image(engine)
    TIMES["base_image_s"] = time.perf_counter() - started
    TIMES["build_cpu_image_s"] = build_image(engine, "graft:cpu", ROOT / "docker" / "Dockerfile.cpu", build_args)
    COUNTS["graft_cpu_image_mb"] = round(int(engine.docker("image", "inspect", "-f", "{{.Size}}", "graft:cpu").stdout) / 1e6)
    return build_args


def _project(engine, name: str, files: list[Path], **env: str) -> Project:
    project = Project(engine, name, files, env=env)
    project.compose("down", "-v", "--remove-orphans", check=False)  # a previous run cut off midway
    return project


def _metrics(project: Project, run: str) -> list[dict]:
    text = project.read_volume("graft-data", f"runs/{run}/metrics.jsonl")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _checkpoints(project: Project, run: str) -> list[int]:
    listing = project.run_in_volume("graft-data", f"import os; print(' '.join(os.listdir('/v/runs/{run}/checkpoints')))")
    return sorted(int(name.removeprefix("step_")) for name in listing.split() if name.startswith("step_"))


def _grafting(line: dict) -> bool:
    return (line.get("peer_hit_rate") or 0) > 0 and line["frac_grafted"] > 0


def _outage_step(line: dict) -> bool:
    """A step whose own peer lookup did not answer (the store down, or backed off from): it ran as GRPO.
    Not the store_* counts: they count what happened during the step's logging window, which can be the next step's
    lookup, started in the background (seen on a fast machine: a step that grafted from its own lookup counted the
    failure of the next one)."""
    return line.get("peer_lookup_ok") == 0.0


def _last_json_line(text: str, key: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and key in line:
            return json.loads(line)
    raise AssertionError(f"no JSON line with {key!r} in:\n{text[-3000:]}")


def _settled(project: Project, generator: str, stats_url: str) -> None:
    """Wait until the generator's current process has stored two batches (a generator restarted by an outage that
    is stopped while it loads its model has stored nothing, and its summary says nothing of what the last did)."""
    mark = {}

    def check():
        restarts, groups = project.inspect(generator)["RestartCount"], http_json(stats_url)["total_groups"]
        if mark.get("restarts") != restarts:
            mark.update(restarts=restarts, groups=groups)
            return False
        return groups >= mark["groups"] + 16
    wait_for(f"{generator} storing again", check, 900, interval_s=3)


def _healthy_again(project: Project, service: str, restarts_before: int):
    def check():
        state = project.inspect(service)
        return state["RestartCount"] > restarts_before and state["State"].get("Health", {}).get("Status") == "healthy"
    return check


def _models_cache_volume() -> str:
    """The toy models, kept on the engine between runs like the image layers, keyed by the toy world's source."""
    sources = sorted((ROOT / "toy").glob("*.py"))
    return "graft-deploy-models-" + hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()[:12]


def _copy_volume(engine, source: str, target: str, labels: dict[str, str] | None = None) -> None:
    """Copy one named volume into another (created here, with compose's labels when it is a project's)."""
    engine.docker("volume", "create", *(a for k, v in (labels or {}).items() for a in ("--label", f"{k}={v}")), target)
    engine.docker("run", "--rm", "-v", f"{source}:/a:ro", "-v", f"{target}:/b", "--entrypoint", "cp", "graft:cpu",
                  "-a", "/a/.", "/b/")


def _seed_models(engine, target: Project) -> bool:
    """The cached toy models into the project's models volume: its `models` service then finds them and builds
    nothing. False when there is no cache yet."""
    cache = _models_cache_volume()
    if engine.docker("volume", "inspect", cache, check=False).returncode != 0:
        return False
    _copy_volume(engine, cache, f"{target.name}_graft-models", {
        "com.docker.compose.project": target.name, "com.docker.compose.volume": "graft-models",
        "com.docker.compose.version": "1.29.2"})
    return True


# ---- the GPU default's models service (it needs no GPU) --------------------------------------------------------

def test_gpu_default_models_service_lays_out_smollm2_when_given_none(engine, images, tmp_path) -> None:
    """docker-compose.yml's one-shot `models` on an empty GRAFT_MODELS_DIR: SmolLM2-135M-Instruct as learner/ and
    peer/ in that host folder, said in its log; run again, it finds them and lays out nothing."""
    folder = tmp_path / "models"
    folder.mkdir()
    project = _project(engine, "graftdeploy-gpumodels", [GPU_FILE], GRAFT_MODELS_DIR=str(folder))
    started = time.perf_counter()
    try:
        result = project.compose("run", "--rm", "-T", "--no-deps", "models", timeout=1200)
        TIMES["gpu_default_models_smollm2_s"] = time.perf_counter() - started
        log = result.stdout + result.stderr
        assert "laying out SmolLM2-135M-Instruct" in log and "as the learner AND as the peer" in log, log[-3000:]
        for name in ("learner", "peer"):
            assert f"models: {name} in /models/{name} (134,515,008 parameters)" in log, log[-3000:]
            assert json.loads((folder / name / "config.json").read_text())["model_type"] == "llama"
            assert (folder / name / "model.safetensors").stat().st_size > 100e6  # float weights, not the 94 MB GGUF
        again = project.compose("run", "--rm", "-T", "--no-deps", "models")
        assert "nothing to build" in again.stdout + again.stderr
    finally:
        project.compose("down", "-v", "--remove-orphans", check=False)


# ---- default topology and its faults --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default(engine, images):
    port = _free_port()
    project = _project(engine, "graftdeploy-default", [CPU_FILE], GRAFT_STORE_PORT=str(port))
    project.url = f"http://127.0.0.1:{port}"
    project.seeded = _seed_models(engine, project)
    started = time.perf_counter()
    project.compose("up", "-d", "--no-build", timeout=1800)  # returns once the models are built and the store healthy
    TIMES["default_up_s" if project.seeded else "default_up_with_models_build_s"] = time.perf_counter() - started
    if not project.seeded:
        _copy_volume(engine, f"{project.name}_graft-models", _models_cache_volume())
    yield project
    project.compose("down", "-v", "--remove-orphans", check=False)
    TIMES["default_total_s"] = time.perf_counter() - started


def test_default_topology_runs_the_pipeline(default: Project) -> None:
    models_log = default.logs("models")
    built = "models: learner in /models/learner" in models_log and "models: peer in /models/peer" in models_log
    assert ("nothing to build" in models_log) if default.seeded else built, models_log
    assert default.inspect("store")["State"]["Health"]["Status"] == "healthy"

    # the generator's groups reach the store: /v1/stats from the host, through the published port, grows
    first = wait_for("the generator's first groups", lambda: http_json(f"{default.url}/v1/stats")["total_groups"], 600,
                     on_timeout=lambda: default.logs("generator")[-3000:])
    wait_for("more groups", lambda: http_json(f"{default.url}/v1/stats")["total_groups"] > first, 300)

    # the trainer grafts the generator's groups and writes checkpoints
    lines = wait_for("a trainer step that grafts", lambda: [m for m in _metrics(default, "graft-learner") if _grafting(m)],
                     900, interval_s=5, on_timeout=lambda: default.logs("trainer")[-3000:])
    assert lines[0]["peer_rollouts_consumed"] > 0
    wait_for("a checkpoint", lambda: _checkpoints(default, "graft-learner"), 600, interval_s=5)
    log = default.logs("trainer")
    assert "grafted," in log and "rows trained on" in log, log[-2000:]

    # the trajectory browser, through the published port
    with urllib.request.urlopen(f"{default.url}/ui/", timeout=10) as response:
        assert response.status == 200 and b"<html" in response.read().lower()


def test_default_topology_survives_a_store_crash_and_a_trainer_crash(default: Project) -> None:
    started = time.perf_counter()
    # SIGKILL the store while the generator pushes and the trainer looks up. The outage must span a trainer step's
    # lookup (a step is long on a busy machine): the store is killed again each time it is back until a trainer step
    # ran without it, as a store in a crash loop would be (Docker's restart delay grows meanwhile).
    steps_before = len(_metrics(default, "graft-learner"))
    groups_before = http_json(f"{default.url}/v1/stats")["total_groups"]
    restarts = default.inspect("store")["RestartCount"]
    killed, outage, deadline = set(), [], time.monotonic() + 900
    while not outage and time.monotonic() < deadline:
        state = default.inspect("store")["State"]
        if state["Running"] and state["Pid"] and state["Pid"] not in killed:
            killed.add(state["Pid"])
            os.kill(state["Pid"], signal.SIGKILL)
        outage = [m for m in _metrics(default, "graft-learner")[steps_before:] if _outage_step(m)]
        time.sleep(1)
    assert outage, f"no trainer step saw the store down in {len(killed)} crashes"
    wait_for("the store back, healthy", _healthy_again(default, "store", restarts), 300, interval_s=1,
             on_timeout=lambda: default.logs("store")[-3000:])
    # nothing the store had counted is lost by the crashes
    assert http_json(f"{default.url}/v1/stats")["total_groups"] >= groups_before
    assert all(m["frac_grafted"] == 0 for m in outage), outage  # GRPO while the store is away
    wait_for("a step that grafts again", lambda: [m for m in _metrics(default, "graft-learner")[steps_before:]
                                                 if _grafting(m) and m["step"] > outage[-1]["step"]], 900, interval_s=5)
    wait_for("the generator pushing again", lambda: http_json(f"{default.url}/v1/stats")["total_groups"] > groups_before, 600)

    # SIGKILL the trainer: brought back, it continues from its newest checkpoint, never from step 0
    newest = _checkpoints(default, "graft-learner")[-1]
    restarts = default.kill_main_process("trainer")
    wait_for("the trainer restarted", lambda: default.inspect("trainer")["RestartCount"] > restarts, 120, interval_s=1)
    resumed = wait_for("the trainer's resume line", lambda: [line for line in default.logs("trainer").splitlines()
                                                             if "resumed from" in line], 600, interval_s=3)
    step = int(resumed[-1].rsplit("at step", 1)[1].split()[0])
    assert step >= newest, (resumed, newest)
    wait_for("a step after the resume", lambda: any(m["step"] == step + 1 for m in _metrics(default, "graft-learner")),
             600, interval_s=5)
    steps = [m["step"] for m in _metrics(default, "graft-learner")]
    assert steps == sorted(set(steps)) and steps[0] == 1, steps  # one history: no second step 1, no step run twice

    # stopped (SIGTERM: it stores the batch in flight), the generator has stored what the store holds: every group
    # it was answered for, none twice. Then plain DuckDB over manifest.json counts what /v1/stats counts.
    _settled(default, "generator", f"{default.url}/v1/stats")
    default.compose("stop", "generator")
    summary = _last_json_line(default.logs("generator"), '"skipped_already_stored"')
    stats = http_json(f"{default.url}/v1/stats")
    peer = next(m for m in stats["models"] if m["model_id"] == "peer")
    assert peer["groups"] == summary["groups"] + summary["skipped_already_stored"], (peer, summary)
    counted = json.loads(default.run_in_volume("graft-data", (
        "import duckdb, json; m = json.load(open('/v/store/manifest.json')); "
        "files = ['/v/store/' + p for p in m['rollouts']]; "
        "print(json.dumps(duckdb.sql(f'SELECT count(DISTINCT group_id), count(*) FROM read_parquet({files})').fetchone()))")))
    stats = http_json(f"{default.url}/v1/stats")
    assert counted == [stats["total_groups"], stats["total_rollouts"]], (counted, stats)
    lines = _metrics(default, "graft-learner")
    COUNTS["default"] = {
        "groups_written": stats["total_groups"], "trainer_steps": len(lines),
        "lookups": sum(m.get("store_lookups", 0) for m in lines),
        "grafted_groups": round(sum(m["frac_grafted"] * 16 for m in lines)),
        "store_crashes": len(killed), "outage_steps": len(outage), "resumed_at_step": step,
        "groups_acknowledged": summary["groups"] + summary["skipped_already_stored"], "groups_readable": peer["groups"]}
    TIMES["faults_s"] = time.perf_counter() - started
    # this topology's last check: down now, so that the next ones get the CPU (the fixture's down is then a no-op)
    default.compose("down", "-v", "--remove-orphans")


# ---- cotrain -------------------------------------------------------------------------------------------------

def test_cotrain_topology(engine, images) -> None:
    port = _free_port()
    project = _project(engine, "graftdeploy-cotrain", [CPU_FILE], GRAFT_STORE_PORT=str(port))
    project.profiles = ["cotrain"]
    seeded = _seed_models(engine, project)
    started = time.perf_counter()
    try:
        project.compose("up", "-d", "--no-build", "store", "cotrain-learner", "cotrain-peer", "cotrain-generator",
                        timeout=1800)
        assert seeded == ("nothing to build" in project.logs("models"))
        for run in ("cotrain-learner", "cotrain-peer"):
            wait_for(f"{run} publishing and grafting the other's groups",
                     lambda run=run: [m for m in _metrics(project, run) if _grafting(m)]
                     and sum(m["store_groups_published"] for m in _metrics(project, run)) > 0,
                     1200, interval_s=5, on_timeout=lambda run=run: project.logs(run)[-3000:])
        # the peer's generator follows cotrain-peer's checkpoints: rows of a newer policy step than 0
        url = f"http://127.0.0.1:{port}"

        def generator_rows(min_step: int) -> list[dict]:
            # every page: cotrain-peer's own published rows (generator graft-train:...) come first in ingest order
            # and can fill a page, so the generator's rows are looked for past it
            rows, cursor = [], ""
            while cursor is not None:
                page = http_json(f"{url}/v1/rollouts?model=peer&min_policy_step={min_step}&limit=500"
                                 + (f"&cursor={cursor}" if cursor else ""))
                rows += [r for r in page["rollouts"] if not r["generator_id"].startswith("graft-train:")]
                cursor = page["next_cursor"]
            return rows

        # a reload, waited for rather than assumed: a generator slow to start (a quarter CPU share on a busy machine)
        # opens with the newest checkpoint already there, and reloads at the next one. Its log says so, a line each.
        marker = "reloaded the newer checkpoint /data/runs/cotrain-peer/checkpoints/step_"

        def reload_lines(log: str) -> list[str]:
            return [line for line in log.splitlines() if marker in line]
        reloaded = wait_for("the generator reloading a newer peer checkpoint",
                            lambda: reload_lines(project.logs("cotrain-generator")), 900, interval_s=5,
                            on_timeout=lambda: project.logs("cotrain-generator")[-3000:])
        newer_step = int(reloaded[0].rsplit("-> ", 1)[1])
        rows = wait_for(f"the generator's rows of policy step {newer_step}", lambda: generator_rows(newer_step), 900,
                        interval_s=5, on_timeout=lambda: project.logs("cotrain-generator")[-3000:])
        project.compose("stop", "cotrain-generator")
        generator_log = project.logs("cotrain-generator")
        summary = _last_json_line(generator_log, '"reloads"')
        # one process (its summary counts what the log shows), one log line per reload
        assert project.inspect("cotrain-generator")["RestartCount"] == 0, generator_log[-4000:]
        assert summary["reloads"] >= 1 and len(reload_lines(generator_log)) == summary["reloads"], summary
        COUNTS["cotrain"] = {"checkpoints_reloaded": summary["reloads"], "newest_policy_step_sampled": max(r["policy_step"] for r in rows),
                             **{f"{run}_grafted_groups": round(sum(m["frac_grafted"] * 16 for m in _metrics(project, run)))
                                for run in ("cotrain-learner", "cotrain-peer")}}
    finally:
        project.compose("down", "-v", "--remove-orphans", check=False)
        TIMES["cotrain_s"] = time.perf_counter() - started


# ---- lake ----------------------------------------------------------------------------------------------------

def test_lake_topology(engine, images) -> None:
    files = [CPU_FILE]
    if images.get("BASE_IMAGE"):  # no Docker Hub: PostgreSQL from Debian and moto's S3 server, on the same base
        started = time.perf_counter()
        for tag, dockerfile in (("graft-test:postgres-15", "Dockerfile.postgres"), ("graft-test:moto", "Dockerfile.s3")):
            build_image(engine, tag, IMAGES / dockerfile, {"BASE_IMAGE": images["BASE_IMAGE"]}, context=IMAGES)
        TIMES["build_lake_images_s"] = time.perf_counter() - started
        files.append(OFFLINE_LAKE_FILE)
    ports = [_free_port(), _free_port()]
    project = _project(engine, "graftdeploy-lake", files, GRAFT_LAKE_PORT_1=str(ports[0]), GRAFT_LAKE_PORT_2=str(ports[1]))
    project.profiles = ["lake"]
    replicas = [f"http://127.0.0.1:{port}" for port in ports]
    _seed_models(engine, project)  # else its models service builds them
    started = time.perf_counter()
    try:
        project.compose("up", "-d", "--no-build", "lake-replica-1", "lake-replica-2", "lake-generator", "lake-trainer",
                        timeout=1800)
        first = wait_for("groups committed to the lake, served by replica 1",
                         lambda: http_json(f"{replicas[0]}/v1/stats")["total_groups"], 600,
                         on_timeout=lambda: project.logs("lake-generator")[-3000:])
        wait_for("the trainer reading replica 1 grafting",
                 lambda: [m for m in _metrics(project, "lake-learner") if _grafting(m)], 1200, interval_s=5,
                 on_timeout=lambda: project.logs("lake-trainer")[-3000:])
        # a replica killed while the generator commits comes back and catches up
        restarts = project.kill_main_process("lake-replica-2")
        wait_for("replica 2 back, healthy", _healthy_again(project, "lake-replica-2", restarts), 300, interval_s=1,
                 on_timeout=lambda: project.logs("lake-replica-2")[-3000:])
        wait_for("more commits", lambda: http_json(f"{replicas[0]}/v1/stats")["total_groups"] > first, 600)
        _settled(project, "lake-generator", f"{replicas[0]}/v1/stats")
        project.compose("stop", "lake-generator")

        def same_stats():
            a, b = (http_json(f"{url}/v1/stats") for url in replicas)
            keys = ("total_groups", "total_rollouts", "models")
            return [a[k] for k in keys] == [b[k] for k in keys] and a["lake"]["snapshot_id"] == a["lake"]["newest_snapshot_id"]
        wait_for("both replicas answering the same /v1/stats", same_stats, 300, interval_s=2)
        summary = _last_json_line(project.logs("lake-generator"), '"skipped_already_stored"')
        stats = http_json(f"{replicas[1]}/v1/stats")
        assert stats["total_groups"] == summary["groups"] + summary["skipped_already_stored"], (stats, summary)
        COUNTS["lake"] = {"groups_committed": stats["total_groups"], "replica_2_restarts": project.inspect("lake-replica-2")["RestartCount"],
                          "trainer_grafted_groups": round(sum(m["frac_grafted"] * 16 for m in _metrics(project, "lake-learner")))}
    finally:
        project.compose("down", "-v", "--remove-orphans", check=False)
        TIMES["lake_s"] = time.perf_counter() - started
