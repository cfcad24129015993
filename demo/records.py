"""What ran: every job's record (the code it imported, the checkout's commit and whether its tree was clean, the host's
CPU and kernels, when), and the check that a resumed demo or study reuses no job computed by other code (issue 60).

A job (`demo.worker`) writes `record` into its done.json as it ends: `files` holds the sha1 of every first-party file it
had imported (the demo's, the toy world's and graft's: `first_party_files`), so a later invocation can tell whether
the cached result is what the code of now would compute. The parent keeps the invocation's own record (`invocation_record`)
in the report's summary.json, with how many jobs it ran, how many it found done, and under which commits and hosts
they ran (`summarize`).

A job found done whose recorded code differs from the files of now, or that has no record (made before records
existed), is refused: the demo stops and names it (`refuse_other_code`), unless told to take it
(`--accept-cached-code`), and then the report's record lists it as such.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKOUT_PACKAGES = ("demo", "toy", "studies")  # the checkout's own code a job or a study runs

# What chooses the kernels besides the CPU: ATen's kernel set, and MKL's instruction set and code branch.
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def kernel_settings(env: dict[str, str]) -> dict[str, str]:
    """The KERNEL_VARIABLES that `env` sets (a job's environment: demo.jobs.child_env), in that order."""
    return {name: env[name] for name in KERNEL_VARIABLES if env.get(name)}


def now() -> str:
    """The time, UTC, to the second (ISO 8601)."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def git_state(root: Path = REPO_ROOT) -> dict:
    """The checkout's commit and whether its tree is clean (no tracked file changed, no untracked file git does not
    ignore); None for both outside a git checkout (an unpacked tarball)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    if commit is None or status is None:
        return {"commit": None, "clean": None}
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {"commit": commit.strip(), "clean": not changed, **({"changed": changed[:20]} if changed else {})}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_state(env: dict[str, str] | None = None) -> dict:
    """The host the numbers came from: CPU model and cores, the kernel settings of the environment and, once torch is
    imported, the kernels it runs (they move the numbers: docs/demo.md, "Numbers across x86-64 CPUs")."""
    env = os.environ if env is None else env
    host = {"cpu": cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(),
            "kernel_settings": kernel_settings(dict(env)),
            "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        host.update(torch=torch.__version__, torch_kernels=torch.backends.cpu.get_cpu_capability())
    return host


def _key(path: Path) -> str | None:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return None


def first_party_files(modules: dict | None = None) -> dict[str, str]:
    """path (from the checkout's root) -> sha1 of every loaded module's file that is this checkout's: graft's (the
    editable install's src/graft/), the demo's, the toy world's, the studies'."""
    import graft

    graft_root = Path(graft.__file__).resolve().parent
    found = {}
    for module in list((modules or sys.modules).values()):
        origin = getattr(module, "__file__", None)
        if not origin or not origin.endswith(".py"):
            continue
        path = Path(origin).resolve()
        key = _key(path)
        inside = key is not None and (key.split("/", 1)[0] in CHECKOUT_PACKAGES or path.is_relative_to(graft_root))
        if inside and path.is_file():
            found[key] = hashlib.sha1(path.read_bytes()).hexdigest()
    return dict(sorted(found.items()))


def package_files() -> dict[str, str]:
    """path -> sha1 of every file of the graft package: the code a subprocess of graft's (the generator) runs, which
    this process has not imported."""
    import graft

    root = Path(graft.__file__).resolve().parent
    return {key: hashlib.sha1(path.read_bytes()).hexdigest() for path in sorted(root.rglob("*.py"))
            if (key := _key(path)) is not None}


def invocation_record(env: dict[str, str], rule: str, argv: list[str]) -> dict:
    """What this invocation is: the checkout's commit and cleanliness, the host, the rule's version, the command and
    when it started."""
    return {**git_state(), "host": host_state(env), "rule": rule, "command": " ".join(argv), "started": now()}


def job_record(started: str, at_start: dict[str, str] | None = None, files: dict[str, str] | None = None) -> dict:
    """A job's record, as it ends: its code (the files it imported, as they were when it started where it had
    imported them by then: `at_start`; and the checkout's commit and cleanliness), host, start and end. A file that
    changed while the job ran is named in `changed_while_running`, and its start digest kept: the check of a later
    invocation then finds the job computed by other code than the file of now. `files`: the code's files as the job
    ends, when not this process's imports (a subprocess's: `package_files`)."""
    files = first_party_files() if files is None else files
    changed = sorted(key for key, digest in (at_start or {}).items() if files.get(key) != digest)
    record = {**git_state(), "files": {**files, **(at_start or {})}, "host": host_state(), "started": started,
              "finished": now()}
    return {**record, "changed_while_running": changed} if changed else record


def files_changed(recorded: dict[str, str]) -> list[str]:
    """The recorded files whose content differs now (or that are gone)."""
    changed = []
    for key, digest in recorded.items():
        path = REPO_ROOT / key
        if not path.is_file() or hashlib.sha1(path.read_bytes()).hexdigest() != digest:
            changed.append(key)
    return changed


def cached_under_other_code(done_files: dict[str, Path]) -> dict[str, str]:
    """job name -> why its cached result is not the code of now's: the files that changed since, or no record."""
    stale = {}
    for name, done in done_files.items():
        record = json.loads(done.read_text()).get("record")
        if not record or "files" not in record:
            stale[name] = "no record of the code it ran (made before issue 60's records)"
            continue
        changed = files_changed(record["files"])
        if changed:
            stale[name] = f"made at {str(record.get('commit'))[:12]}; changed since: " + ", ".join(changed[:4]) + (
                f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return stale


def refuse_other_code(stale: dict[str, str], accept: bool) -> None:
    """Stop when jobs found done were computed by other code, unless `accept` (--accept-cached-code)."""
    if stale and not accept:
        listed = "; ".join(f"{name}: {why}" for name, why in list(stale.items())[:6])
        raise SystemExit(
            f"{len(stale)} job(s) found done were computed by other code than this checkout's ({listed}"
            f"{' ...' if len(stale) > 6 else ''}). Their results would be reported as this code's: remove them (the "
            "output folder's runs/ or models/) to compute them again, or pass --accept-cached-code to take them, "
            "which the report's record then lists")


def summarize(invocation: dict, done_files: dict[str, Path], ran: list[str], accepted: dict[str, str]) -> dict:
    """The report's record: this invocation's (commit, clean, host, start, end), the jobs it ran and found done, the
    commits and CPUs every job ran under, and the cached ones taken though computed by other code."""
    commits, hosts, kernels = Counter(), Counter(), Counter()
    for done in done_files.values():
        record = json.loads(done.read_text()).get("record") or {}
        host = record.get("host") or {}
        commits[f"{str(record.get('commit'))[:12]}{'' if record.get('clean') else ' (tree not clean)'}"
                if record else "no record"] += 1
        hosts[host.get("cpu", "no record")] += 1
        kernels[host.get("torch_kernels", "no record")] += 1
    return {**invocation, "finished": now(), "jobs_ran": len(ran), "jobs_found_done": len(done_files) - len(ran),
            "job_commits": dict(commits), "job_cpus": dict(hosts), "job_kernels": dict(kernels),
            "accepted_from_other_code": accepted}


def run_provenance(done: dict) -> dict:
    """A run's entry in summary.json: where and when it ran and under which code (its done.json's record, less the
    file digests)."""
    record = done.get("record")
    if not record:
        return {"record": None}
    host = record.get("host", {})
    return {"record": {"commit": record.get("commit"), "clean": record.get("clean"), "cpu": host.get("cpu"),
                       "kernels": host.get("torch_kernels"), "kernel_settings": host.get("kernel_settings"),
                       "started": record.get("started"), "finished": record.get("finished")}}
