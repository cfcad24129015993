"""A Docker engine for the deploy tests, the images they run, and docker-compose projects on it.

- `find_or_start_engine`: an engine that answers (DOCKER_HOST, or the default socket); else, as root with
  dockerd installed, a private one (overlay2, no iptables, its data root under GRAFT_CACHE_DIR so that image
  layers are kept between runs), stopped by its pid at the end; else None and the reason.
- `base_image`: the image every test image is built FROM. Where Docker Hub answers that is python:3.11-slim;
  where it cannot (this CI), a Debian bookworm built with debootstrap from the machine's own apt mirror, with the
  machine's CA bundle, pip settings and wheel folder inside, so that pip in a build behaves as it does here.
  None of this machine is written into the Dockerfiles or compose files: it enters as build arguments.
- `Project`: `docker-compose -p NAME -f ...` with the helpers the tests need.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from graft.rollouts.models import cache_dir

ROOT = Path(__file__).resolve().parents[3]
# Debian's docker client: with DOCKER_BUILDKIT it builds with BuildKit; a newer client earlier on the PATH may lack
# buildx. Any client works for the rest.
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")
BASE_TAG = "graft-test-base:bookworm"
PIP_FILES = ("/etc/pip.conf", "/etc/xdg/pip")  # the machine's pip settings, copied into the offline base


@dataclass
class Engine:
    host: str  # DOCKER_HOST value
    pid: int | None = None  # a private dockerd we started (stopped by this pid), else None
    log: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    def docker(self, *args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([DOCKER, *args], env=self.env, check=check, timeout=timeout, text=True,
                              capture_output=True, **kwargs)

    def stop(self) -> None:
        if self.pid is None:
            return
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.5)
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)
        if self.log is not None:
            shutil.rmtree(self.log.parent, ignore_errors=True)  # its socket, pid file, exec root and log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of ours counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _answers(host: str) -> bool:
    try:
        result = subprocess.run([DOCKER, "version", "--format", "{{.Server.Version}}"], env={**os.environ, "DOCKER_HOST": host},
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def find_or_start_engine() -> tuple[Engine | None, str]:
    """(engine, "") or (None, why there is none)."""
    if shutil.which(DOCKER) is None and not Path(DOCKER).exists():
        return None, "no docker client installed (make system-deps installs docker.io)"
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if _answers(host):
        return Engine(host), ""
    dockerd = shutil.which("dockerd")
    if os.geteuid() != 0 or dockerd is None:
        return None, f"no Docker engine answers at {host}, and a private one needs root and dockerd"
    work = cache_dir() / "docker"
    work.mkdir(parents=True, exist_ok=True)
    # the exec root and socket paths must stay short (unix socket paths are limited to 108 bytes)
    run = Path(tempfile.mkdtemp(prefix="graft-dockerd-"))
    socket, pidfile, log = run / "docker.sock", run / "docker.pid", run / "dockerd.log"
    process = subprocess.Popen(
        [dockerd, "--storage-driver", "overlay2", "--iptables=false", "--data-root", str(work / "data-root"),
         "--exec-root", str(run / "exec"), "-H", f"unix://{socket}", "--pidfile", str(pidfile)],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine(f"unix://{socket}", pid=process.pid, log=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return None, f"dockerd exited with {process.returncode}: {log.read_text()[-2000:]}"
        if socket.exists() and _answers(engine.host):
            return engine, ""
        time.sleep(0.5)
    engine.stop()
    return None, f"dockerd did not answer within 60 s: {log.read_text()[-2000:]}"


def _docker_hub_answers(engine: Engine) -> bool:
    if engine.docker("image", "inspect", "python:3.11-slim", check=False).returncode == 0:
        return True
    return engine.docker("pull", "python:3.11-slim", check=False, timeout=300).returncode == 0


def _apt_mirror() -> str:
    """The machine's Debian mirror, read from its apt sources (deb822 or one-line form)."""
    for path in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")) + [Path("/etc/apt/sources.list")]:
        if not path.exists():
            continue
        text = path.read_text()
        for match in re.finditer(r"^URIs:\s*(\S+)|^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.MULTILINE):
            uri = match.group(1) or match.group(2)
            if "security" not in uri:
                return uri
    raise RuntimeError("no Debian mirror in /etc/apt: cannot debootstrap a base image")


def base_image(engine: Engine) -> tuple[str, dict[str, str]]:
    """(image, build args) for the test images: python:3.11-slim with the public indexes where Docker Hub answers,
    else the offline base (built once per engine data root)."""
    if _docker_hub_answers(engine):
        return "python:3.11-slim", {}
    build_args = {"BASE_IMAGE": BASE_TAG, "TORCH_INDEX_URL": ""}  # torch from pip's settings: index and find-links
    if engine.docker("image", "inspect", BASE_TAG, check=False).returncode == 0:
        return BASE_TAG, build_args
    if shutil.which("debootstrap") is None:
        raise RuntimeError("Docker Hub cannot be reached and debootstrap is not installed (make system-deps installs it)")
    with tempfile.TemporaryDirectory(prefix="graft-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python3-pip,ca-certificates",
                        "bookworm", str(rootfs), _apt_mirror()], check=True, capture_output=True, timeout=1800)
        _copy_pip_settings(rootfs)
        changes = ["ENV LANG=C.UTF-8"] + [f"ENV {k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("PIP_")]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([DOCKER, "import", *(a for c in changes for a in ("--change", c)), "-", BASE_TAG],
                       stdin=tar.stdout, env=engine.env, check=True, capture_output=True, timeout=600)
        tar.wait()
    return BASE_TAG, build_args


def _copy_pip_settings(rootfs: Path) -> None:
    """The machine's CA bundle (its proxy signs with it), pip config files and the wheel folders PIP_FIND_LINKS
    names, at the same paths inside the base."""
    bundle = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    paths = [bundle, *map(Path, PIP_FILES)]
    paths += [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if p.startswith("/")]
    for path in paths:
        if not path.exists():
            continue
        target = rootfs / path.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)


def build_image(engine: Engine, tag: str, dockerfile: Path, build_args: dict[str, str], context: Path = ROOT) -> float:
    """`docker build --network host` (bridge networks may have no way out; a build that pip-installs needs one);
    returns the seconds it took."""
    started = time.perf_counter()
    args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
    result = subprocess.run([DOCKER, "build", "--network", "host", "-t", tag, "-f", str(dockerfile), *args, str(context)],
                            env={**engine.env, "DOCKER_BUILDKIT": "0"}, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"docker build {tag} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return time.perf_counter() - started


@dataclass
class Project:
    """One docker-compose project (its own network and volumes) on `engine`."""

    engine: Engine
    name: str
    files: list[Path]
    env: dict[str, str] = field(default_factory=dict)  # compose variables (published ports)
    profiles: list[str] = field(default_factory=list)
    url: str = ""  # the store's published address, when the test knows it

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        command = ["docker-compose", "-p", self.name, *(a for f in self.files for a in ("-f", str(f))),
                   *(a for p in self.profiles for a in ("--profile", p)), *args]
        result = subprocess.run(command, env={**self.engine.env, **self.env}, cwd=ROOT, text=True,
                                capture_output=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).stdout.split()
        assert ids, f"{service}: no container"
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(self.engine.docker("inspect", self.container(service)).stdout)[0]

    def logs(self, service: str) -> str:
        result = self.compose("logs", "--no-color", "--no-log-prefix", service, check=False)
        return result.stdout + result.stderr

    def kill_main_process(self, service: str) -> int:
        """SIGKILL of the container's main process from the host, as a crash would (`docker kill` counts as a stop
        and fires no restart policy); returns the restart count before."""
        state = self.inspect(service)
        os.kill(state["State"]["Pid"], signal.SIGKILL)
        return state["RestartCount"]

    def read_volume(self, volume: str, path: str, image: str = "graft:cpu") -> str:
        """A file of a named volume, read by a throwaway container (works for any engine, local or not)."""
        return self.engine.docker("run", "--rm", "-v", f"{self.name}_{volume}:/v:ro", "--entrypoint", "cat", image,
                                  f"/v/{path}").stdout

    def run_in_volume(self, volume: str, script: str, image: str = "graft:cpu") -> str:
        """`python -c script` in a throwaway container with the volume at /v (read-only)."""
        return self.engine.docker("run", "--rm", "-v", f"{self.name}_{volume}:/v:ro", "--entrypoint", "python", image,
                                  "-c", script).stdout


def wait_for(what: str, check, timeout_s: float, interval_s: float = 2.0, on_timeout=None):
    """Poll `check()` until it returns a truthy value (returned); AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as e:  # a service still starting: connection refused, a file not yet written
            last_error = e
        time.sleep(interval_s)
    detail = on_timeout() if on_timeout else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last_error!r})\n{detail}")


def http_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())
