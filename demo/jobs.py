"""Run the demo's jobs as processes, at most `slots` at once, with one progress bar.

A job is one or more commands started together (a co-training pair is two trainers that must run
at the same time: it takes two slots). A job starts when the jobs it depends on have finished, in
the order given (a ready job that does not fit yet is overtaken only while a job as big runs, which
will make room for it); it is finished when its `done` file exists. Each command's output goes to a
log file beside it, so the terminal shows only the demo's own progress bar.

`python -m demo.worker ...` commands run in children of a multiprocessing forkserver that has
imported `demo.worker` (torch, transformers) once: importing them takes about 7 s of a busy core,
for each of the demo's ~20 jobs. Any other command runs as a plain subprocess.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from demo.records import cached_under_other_code, refuse_other_code, summarize
from graft.rollouts.files import write_text_atomic


@dataclass
class Job:
    name: str
    commands: list[list[str]]  # started together; each takes one slot
    logs: list[Path]  # one per command
    done: list[Path]  # the job is finished when every one of these files exists
    progress: Callable[[], float]  # units of work done so far (for the bar)
    total: float  # units of work of the whole job
    deps: list[str] = field(default_factory=list)
    after: Callable[[], None] | None = None  # run in the parent when the commands have exited successfully
    processes: list[subprocess.Popen | ForkedWorker] = field(default_factory=list)
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def slots(self) -> int:
        return len(self.commands)

    def is_done(self) -> bool:
        return all(path.exists() for path in self.done)

    @property
    def timing_path(self) -> Path:
        """Where the job's wall seconds are kept, so that a rerun that finds the job done still reports them."""
        return self.done[0].with_name(f"{self.done[0].stem}.wall_s")


class CodeGuard:
    """The Python files the jobs run, as they were when the demo started.

    A job reads the checkout live: one started after a change (a merge, a checkout) runs other code than the jobs
    before it, and a worker that imports a module late runs a mix of both (a demo run once died of that halfway). The
    demo therefore starts no job once a file has changed; `changed` names the files. Files are compared by content
    whenever their size or modification time moved."""

    def __init__(self, roots: list[Path]):
        self.roots = roots
        self._files = {path: (stat, _digest(path)) for path, stat in self._stat().items()}

    @classmethod
    def of_checkout(cls) -> CodeGuard:
        """The demo's and the studies' own code and the installed graft package's (the checkout's src/graft/ under
        `make install`)."""
        import graft

        repo = Path(__file__).resolve().parents[1]
        return cls([repo / "demo", repo / "toy", repo / "studies", Path(graft.__file__).resolve().parent])

    def _stat(self) -> dict[Path, tuple[int, int]]:
        files = {}
        for root in self.roots:
            for path in root.rglob("*.py"):
                try:
                    st = path.stat()
                except FileNotFoundError:  # removed while listed (a checkout under way): counted as removed
                    continue
                files[path] = (st.st_mtime_ns, st.st_size)
        return files

    def changed(self) -> list[str]:
        """The files added, removed or edited since the start (paths as found), sorted; [] when none."""
        now = self._stat()
        moved = set(now) ^ set(self._files)
        moved |= {path for path, stat in now.items() if path in self._files and self._files[path][0] != stat
                  and _digest(path) != self._files[path][1]}
        return sorted(str(path) for path in moved)


def _digest(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def run_jobs(jobs: list[Job], slots: int, desc: str, env: dict[str, str], guard: CodeGuard | None = None) -> dict[str, float]:
    """Run every job not already done; returns {job name: wall seconds} of every job, those done by an
    earlier invocation included (from the time it recorded then). With a `guard`, no job starts once the code has
    changed: the running ones finish, then a RuntimeError names the files."""
    names = {job.name for job in jobs}
    for job in jobs:
        unknown = set(job.deps) - names
        if unknown:
            raise ValueError(f"job {job.name} depends on unknown jobs {sorted(unknown)}")
        if job.slots > slots:
            raise ValueError(f"job {job.name} needs {job.slots} processes at once but only {slots} slots are allowed")
    pending = [job for job in jobs if not job.is_done()]
    to_run = {job.name for job in pending}  # the bar counts these
    finished = {job.name for job in jobs if job.is_done()}
    running: list[Job] = []
    changed: list[str] = []  # the guard's files, once the code has changed: no more jobs start
    timings = {job.name: float(job.timing_path.read_text()) for job in jobs if job.name in finished and job.timing_path.exists()}
    bar = tqdm(total=sum(job.total for job in pending), desc=desc, unit="step", dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} [{elapsed}<{remaining}] {postfix}")
    try:
        while (pending and not changed) or running:
            for job in [] if changed else list(pending):  # start what fits, in order
                if not all(d in finished for d in job.deps):
                    continue
                if job.slots > slots - sum(j.slots for j in running):
                    # Later jobs may take the free slots meanwhile only if a running job at least this big will
                    # make room for it when it ends; otherwise they would keep it waiting to the end.
                    if not any(j.slots >= job.slots for j in running):
                        break
                    continue
                if guard is not None and (changed := guard.changed()):
                    tqdm.write(f"the code changed while the demo ran ({_listed(changed)}): no further job starts; "
                               f"waiting for the {len(running)} running")
                    break
                _start(job, env)
                pending.remove(job)
                running.append(job)
            time.sleep(0.5)
            for job in list(running):
                codes = [p.poll() for p in job.processes]
                failed = [(cmd, log, c) for cmd, log, c in zip(job.commands, job.logs, codes) if c not in (None, 0)]
                if failed:
                    _stop_all(running)
                    cmd, log, code = failed[0]
                    raise RuntimeError(f"job {job.name} failed (exit {code}): {' '.join(cmd)}\n--- last lines of {log} ---\n{_tail(log)}")
                if all(c == 0 for c in codes):
                    if job.after is not None:
                        job.after()
                    if not job.is_done():
                        raise RuntimeError(f"job {job.name} exited cleanly but did not write {[str(p) for p in job.done if not p.exists()]}")
                    job.finished_at = time.perf_counter()
                    timings[job.name] = job.finished_at - job.started_at
                    write_text_atomic(job.timing_path, f"{timings[job.name]:.1f}", durable=False)
                    running.remove(job)
                    finished.add(job.name)
            done_units = sum(job.total for job in jobs if job.name in finished and job.name in to_run)
            done_units += sum(min(job.progress(), job.total) for job in running)
            bar.n = done_units
            bar.set_postfix_str(", ".join(job.name for job in running), refresh=False)
            bar.refresh()
    except BaseException:
        _stop_all(running)
        raise
    finally:
        bar.close()
    if changed:
        raise RuntimeError(
            f"the code changed while the demo ran ({_listed(changed)}); {len(pending)} jobs not started. The "
            f"{len(finished)} finished are kept, as the code before the change made them: the same command goes on "
            "from them under the new code (remove the output folder's runs/ for every job under one code), or "
            "restore the files first.")
    return timings


def run_recorded(jobs: list, slots: int, desc: str, env: dict[str, str], guard, invocation: dict,
                 accept_cached_code: bool) -> tuple[dict[str, float], dict]:
    """run_jobs with the records (demo.records): refuse the jobs found done that other code computed (unless
    `accept_cached_code`), run the rest, and return the timings and the report's record (`summarize`)."""
    found = {job.name: job.done[0] for job in jobs if job.is_done()}
    stale = cached_under_other_code(found)
    refuse_other_code(stale, accept_cached_code)
    timings = run_jobs(jobs, slots, desc=desc, env=env, guard=guard)
    ran = [job.name for job in jobs if job.name not in found]
    return timings, summarize(invocation, {job.name: job.done[0] for job in jobs}, ran, stale)


def _listed(paths: list[str], most: int = 3) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


PRELOADED = "demo.worker"
_forkserver: multiprocessing.context.BaseContext | None = None


class ForkedWorker:
    """`python -m demo.worker ARGS` as a child of the forkserver, with the part of Popen's interface used here."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]):
        global _forkserver
        if _forkserver is None:
            # The server starts with the first child and keeps this environment (HF offline, one OpenMP thread: read
            # when torch and huggingface_hub are imported, which the server does once, for every child).
            os.environ.update(env)
            _forkserver = multiprocessing.get_context("forkserver")
            _forkserver.set_forkserver_preload([PRELOADED])
        self.process = _forkserver.Process(target=_run_worker, args=(args, str(log)))
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(PRELOADED, timeout or 0)
        return self.process.exitcode


def _run_worker(args: list[str], log: str) -> None:
    """In the forked child: output to the job's log, then demo.worker's main as if run with `python -m`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [PRELOADED, *args]
    from demo.worker import main

    main()


def _start(job: Job, env: dict[str, str]) -> None:
    job.started_at = time.perf_counter()
    for command, log in zip(job.commands, job.logs):
        log.parent.mkdir(parents=True, exist_ok=True)
        if command[:3] == [sys.executable, "-m", PRELOADED]:
            job.processes.append(ForkedWorker(command[3:], log, env))
            continue
        with open(log, "ab") as out:
            job.processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))


def _stop_all(running: list[Job]) -> None:
    for job in running:
        for process in job.processes:
            if process.poll() is None:
                process.terminate()
        for process in job.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return text.replace("\r", "\n")[-chars:]


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


# One arithmetic under every kernel choice of a machine (issue 25: the demo's table moved between two AVX-512 machines). ATen picks
# its vectorised kernels by the CPU's ISA (AVX2, AVX-512: other lane widths, other orders of summation) and MKL its
# sgemm by the CPU's vendor and model. ATen's "default" kernels (baseline x86-64) and MKL's COMPATIBLE branch (SSE2;
# the one fixed branch MKL keeps on non-Intel CPUs: there MKL_CBWR=AVX2 falls back to AUTO without a word) are one
# code path everywhere. Both are read when torch loads: they go in the jobs' environment, never set after an import.
# Measured (docs/demo.md, "Numbers across x86-64 CPUs"): the same bits under every choice one machine offers, but an AMD
# EPYC and an Intel Xeon, both pinned, still train other weights; what differs between them is not one of these switches.
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
def portable_kernels_available() -> bool:
    """Whether this CPU runs PORTABLE_KERNELS: every x86-64 CPU does (an Arm CPU has neither ATen's x86 kernels nor MKL)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def child_env(portable_kernels: bool = False) -> dict[str, str]:
    """The environment of every job: offline, one thread, the repo importable, and (portable_kernels) the kernels
    one machine computes alike under every kernel choice, whatever the caller's environment says."""
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"})
    if portable_kernels:
        env.update(PORTABLE_KERNELS)
    return env
