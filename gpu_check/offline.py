"""The offline form of the GPU check (`python -m gpu_check --offline`): its folder, built here with the
network, and the environment it installs on a GPU machine that has none.

    python -m gpu_check.offline build      # `make gpu-check-offline-folder`: build/gpu-offline/ (about 30 MB)

The folder holds
    wheels/   `pip download` of gpu_check/offline_requirements.txt for CPython 3.12 on manylinux_2_28 x86_64
              (binary wheels only), with pip and setuptools (to bootstrap pip and build the project), less sympy
              and mpmath: torch requires them, so a machine with torch has them;
    model/    a tiny Llama (2 layers, d = 64) with a byte-level BPE tokenizer and a chat template, toy-trained here
              on the toy task `a+b=` -> `\\boxed{a+b}` so that its groups have mixed rewards (toy.world.cached_chat_model);
    MANIFEST.json  what is in it, with sizes.

On the GPU machine the check makes .venv-gpu-offline from the machine's own python3, which keeps seeing the
machine's torch, transformers, pyarrow, accelerate and safetensors; pip is bootstrapped from the folder, the
requirements come from the folder alone (--no-index), and the project goes in --no-deps (editable).

This module uses the standard library only at import: it runs under a bare python3 before the environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FOLDER = REPO_ROOT / "build" / "gpu-offline"
ENV_DIR = REPO_ROOT / ".venv-gpu-offline"
REQUIREMENTS = Path(__file__).resolve().parent / "offline_requirements.txt"
BOOTSTRAP = ("pip==26.3", "setuptools==81.0.0")  # pip for the new environment; setuptools builds the project
# glibc >= 2.28 (torch 2.11's own wheel is manylinux_2_28): every manylinux tag up to it, by name (pip takes them as given)
PLATFORM = ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12",
            *[flag for abi in ("cp312", "abi3", "none") for flag in ("--abi", abi)],
            *[flag for tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_26", "manylinux_2_24", "manylinux_2_17",
                               "manylinux2014", "manylinux_2_12", "manylinux2010", "manylinux_2_5", "manylinux1")
              for flag in ("--platform", f"{tag}_x86_64")]]
ON_THE_MACHINE = {"sympy", "mpmath"}  # torch's own requirements (7 MB): present wherever torch is
SIZE_LIMIT = 64 << 20  # what may be sent to the GPU machine: the repository and this folder together


def _pip_offline_env() -> dict[str, str]:
    """pip reads no configuration and no PIP_* source: the folder is the only one."""
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    return dict(env, PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")


def folder_digest(folder: Path) -> str:
    """Changes when the folder, the requirements or pyproject.toml change: the environment is then rebuilt."""
    manifest = folder / "MANIFEST.json"
    parts = [manifest.read_bytes() if manifest.exists() else b"", REQUIREMENTS.read_bytes(),
             (REPO_ROOT / "pyproject.toml").read_bytes()]
    return hashlib.sha1(b"\0".join(parts)).hexdigest()[:12]


def install_commands(machine_python: str, folder: Path) -> list[list[str]]:
    """The commands that make ENV_DIR from the machine's python3 and the folder alone."""
    env_python = str(ENV_DIR / "bin" / "python")
    wheels = folder / "wheels"
    pip_wheel = next(iter(sorted(wheels.glob("pip-*.whl"))), wheels / "pip-(missing).whl")
    offline = ["install", "-q", "--no-index", "--find-links", str(wheels)]
    return [
        [machine_python, "-m", "venv", "--system-site-packages", "--without-pip", str(ENV_DIR)],
        # pip runs from its own wheel to install itself: the machine's python3 may have no ensurepip
        [env_python, f"{pip_wheel}/pip", *offline, BOOTSTRAP[0]],
        [env_python, "-m", "pip", *offline, "-r", str(REQUIREMENTS)],
        [env_python, "-m", "pip", *offline, "--no-deps", "-e", str(REPO_ROOT)],
    ]


def link_machine_packages(machine_python: str) -> str | None:
    """When the machine's python is itself a virtual environment (the CPU rehearsal's), --system-site-packages
    shows its base interpreter's packages, not its own: a .pth file adds its site-packages. None when not needed."""
    probe = "import json, site, sys; print(json.dumps([sys.prefix != sys.base_prefix, site.getsitepackages()]))"
    in_venv, site_dirs = json.loads(subprocess.run([machine_python, "-c", probe], capture_output=True, text=True,
                                                   check=True).stdout)
    if not in_venv:
        return None
    env_site = Path(sysconfig.get_path("purelib", vars={"base": str(ENV_DIR), "platbase": str(ENV_DIR)}))
    if not env_site.is_dir():  # this interpreter's layout differs from the machine's: ask the new environment
        env_site = Path(subprocess.run([str(ENV_DIR / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    (env_site / "_machine_packages.pth").write_text("\n".join(site_dirs) + "\n")
    return ", ".join(site_dirs)


def build_env(machine_python: str, folder: Path, log_path: Path) -> str:
    """Make ENV_DIR (reused while the folder is unchanged); what was done. Raises RuntimeError with pip's reason."""
    if not (folder / "MANIFEST.json").exists():
        raise RuntimeError(f"{folder} holds no MANIFEST.json: build it where there is a network "
                           "(make gpu-check-offline-folder) and send it with the repository")
    stamp = ENV_DIR / f".installed-{folder_digest(folder)}"
    if stamp.exists():
        return f"reused {ENV_DIR.name} (delete it to rebuild)"
    shutil.rmtree(ENV_DIR, ignore_errors=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    linked = None
    with open(log_path, "w") as log:
        for index, command in enumerate(install_commands(machine_python, folder)):
            print(f"[env] {' '.join(command)}", flush=True)
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=_pip_offline_env())
            if result.returncode != 0:
                lines = [line.strip() for line in log_path.read_text().splitlines() if line.strip().startswith("ERROR")]
                raise RuntimeError(f"`{' '.join(command[:4])} ...` failed: {lines[-1] if lines else 'see ' + str(log_path)}")
            if index == 0:
                linked = link_machine_packages(machine_python)
    stamp.touch()
    wheels = len(list((folder / "wheels").glob("*.whl")))
    return f"{ENV_DIR.name} from {machine_python} and {wheels} wheels of {folder.name}/ (--no-index)" + (
        f"; the machine's packages from {linked}" if linked else "")


def tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def repository_size() -> int:
    """Bytes of the committed tree as `git archive` packs it (tar, uncompressed)."""
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO_ROOT, capture_output=True, check=True)
    return len(archive.stdout)


def build_folder(folder: Path) -> dict:
    """Download the wheels and build the model into `folder` (replaced); the manifest."""
    from graft.rollouts.files import write_text_atomic
    from toy.world import cached_chat_model

    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    wheels = staging / "wheels"
    command = [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), *PLATFORM, *BOOTSTRAP, "-r", str(REQUIREMENTS)]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO_ROOT)
    for wheel in wheels.glob("*.whl"):
        if wheel.name.split("-")[0].lower().replace("_", "-") in ON_THE_MACHINE:
            wheel.unlink()
    shutil.copytree(cached_chat_model(), staging / "model")
    manifest = {
        "requirements": REQUIREMENTS.read_text().splitlines(),
        "wheels": {w.name: w.stat().st_size for w in sorted(wheels.glob("*.whl"))},
        "model": {f.name: f.stat().st_size for f in sorted((staging / "model").iterdir())},
    }
    manifest["bytes"] = tree_size(staging)
    write_text_atomic(staging / "MANIFEST.json", json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return manifest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="download the wheels and build the model into the folder (needs the network)")
    build.add_argument("--out", type=Path, default=FOLDER)
    args = parser.parse_args()
    manifest = build_folder(args.out.resolve())
    repo = repository_size()
    total = manifest["bytes"] + repo
    print(f"{args.out}: {len(manifest['wheels'])} wheels and the model, {manifest['bytes'] / 2**20:.1f} MiB; the repository "
          f"(git archive) {repo / 2**20:.1f} MiB; together {total / 2**20:.1f} MiB of the {SIZE_LIMIT >> 20} MiB that "
          f"may be sent: {'fits' if total <= SIZE_LIMIT else 'TOO LARGE'}")
    return 0 if total <= SIZE_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
