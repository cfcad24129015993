"""The README's and docs/ pages' commands, run as printed: every ```bash and ```python block of README.md and
docs/*.md runs in a shell of its own (a reader pasting it into a new terminal), from a temporary folder laid out
like the checkout (configs/, data/ and .venv linked in, so nothing is written into the checkout), against a real
`graft-store serve` on a free loopback port (the one substitution: 8600 -> that port), and must exit 0.

Which blocks run is read from the pages, so a changed command is tested as changed. The rule, an HTML comment on
the line before a block (invisible on the rendered page):
- `<!-- walk: serve -->`: the block serves the store; it runs in the background, later blocks of the page run while
  it answers /v1/health;
- `<!-- walk: server-stopped -->`: the page's server is stopped (SIGTERM, as Ctrl-C) before the block runs;
- `<!-- walk: skip REASON ... -->`: not run, REASON one of SKIP_REASONS (a GPU, Docker, a long run, the files
  `make demo` writes, another machine's hosts or paths, a template with placeholders, or `tested TEST_FILE`: a test
  that reads the block from this page runs it on a store it builds, with more checks than an exit status);
- `<!-- walk: minutes N -->`: the block runs for minutes on a CPU (a real model's training step): it may run
  `graft-train train`, and gets N minutes instead of BLOCK_TIMEOUT_S.
A block without a comment runs. A block naming a command that needs what the walk has not (NEEDS_A_SKIP) must carry
a skip (or, for `graft-train train` on a CPU, `minutes`), so no long or GPU command runs, or is left out, without
saying so. SQL blocks are DuckDB's and PostgreSQL's
(tests/store/test_store_readers.py and tests/store/test_lake.py run them); other fences are not commands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
SKIP_REASONS = {"gpu", "docker", "long", "after-demo", "elsewhere", "example", "tested"}
RUN_LANGUAGES = {"bash", "python"}
# what a block may not run untagged: containers, GPUs, the long make targets, training, a machine's own models
NEEDS_A_SKIP = re.compile(r"docker-compose|torchrun|nvidia-smi|make (demo|test|gpu-check)|graft-train train|/models/|demo_out/")
BLOCK_TIMEOUT_S = 180  # a block here is a few CLI starts and curl calls; the limit only stops a hung one


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    tag: str  # "" (run), "serve", "server-stopped" or "skip REASON ..."

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        tag = re.fullmatch(r"<!-- walk: (.*?) -->", before)
        found.append(Block(page, i + 1, opening.group(1), "\n".join(lines[i + 1 : end]) + "\n", tag.group(1) if tag else ""))
        i = end + 1
    return found


def test_every_block_is_run_or_skipped_by_the_rule():
    problems, ran = [], 0
    for page in PAGES:
        for block in blocks(page):
            if block.tag.startswith("skip"):
                reasons = re.split(r"[,:]?\s+", block.tag.removeprefix("skip").strip())
                if not reasons[0] or reasons[0].rstrip(",:") not in SKIP_REASONS:
                    problems.append(f"{block}: skip needs a reason of {sorted(SKIP_REASONS)}, not {block.tag!r}")
                elif reasons[0] == "tested":
                    test = REPO_ROOT / reasons[1] if len(reasons) > 1 else None
                    if test is None or not test.is_file() or page.name not in test.read_text():
                        problems.append(f"{block}: `skip tested` names no test file that reads {page.name}")
            elif block.tag not in ("", "serve", "server-stopped") and not re.fullmatch(r"minutes \d+", block.tag):
                problems.append(f"{block}: unknown walk tag {block.tag!r}")
            elif block.language in RUN_LANGUAGES:
                ran += 1
                needs = {m.group(0) for m in NEEDS_A_SKIP.finditer(block.code)}
                if block.tag.startswith("minutes") and needs <= {"graft-train train"}:
                    continue  # said out loud: a CPU training step, given its minutes
                if needs:
                    problems.append(f"{block}: runs {NEEDS_A_SKIP.search(block.code).group(0)!r}: tag it <!-- walk: skip REASON -->")
            elif block.tag:
                problems.append(f"{block}: a {block.language or 'plain'} block is never run: its tag {block.tag!r} says nothing")
    assert not problems, "\n".join(problems)
    assert ran >= 6, f"only {ran} blocks run: the walk would test nothing"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _workspace(tmp_path: Path) -> Path:
    """A folder laid out like the checkout for the commands' relative paths; what they write stays in it."""
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    for name in ("configs", "data"):
        (cwd / name).symlink_to(REPO_ROOT / name)
    (cwd / ".venv").symlink_to(Path(sys.prefix))  # the environment running this test: its bin/activate, its scripts
    return cwd


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_STORE_")}  # the pages set their own
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])  # this checkout's code, whatever the
    # environment installed: graft from src/, the checkout-only folders (toy/, demo/) from the root
    return env


def _command(language: str, code: str) -> list[str]:
    if language == "python":
        return [sys.executable, "-c", code]
    return ["bash", "-e", "-o", "pipefail", "-c", code]


class _Server:
    def __init__(self, block: Block, code: str, cwd: Path, env: dict[str, str], port: int, log: Path):
        self.block, self.port, self.log = block, port, log
        self.proc = subprocess.Popen(["bash", "-e", "-c", code], cwd=cwd, env=env, stdout=log.open("wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        # curl, as the pages use it, retries until the server answers (or the limit passes)
        ready = subprocess.run(["curl", "-sf", "--retry", str(BLOCK_TIMEOUT_S), "--retry-connrefused", "--retry-delay", "1",
                                "--retry-max-time", str(BLOCK_TIMEOUT_S), f"http://127.0.0.1:{port}/v1/health"],
                               capture_output=True, timeout=BLOCK_TIMEOUT_S + 30)
        if ready.returncode != 0:
            exited = self.proc.poll()
            self.stop()
            raise AssertionError(f"{block}: no answer on port {port} (server exit status {exited}):\n{log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the whole session: bash and the server it started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        assert "Traceback" not in self.log.read_text(), f"{self.block}: the server logged an error:\n{self.log.read_text()}"


RUNNABLE = [p for p in PAGES if any(b.language in RUN_LANGUAGES and not b.tag.startswith("skip") for b in blocks(p))]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed (the pages' HTTP calls use it)")
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(REPO_ROOT)) for p in RUNNABLE])
def test_the_pages_commands_run_as_printed(page: Path, tmp_path: Path):
    cwd, env, port = _workspace(tmp_path), _environment(), _free_port()
    server: _Server | None = None
    ran = []
    try:
        for block in blocks(page):
            if block.language not in RUN_LANGUAGES or block.tag.startswith("skip"):
                continue
            code = block.code.replace("8600", str(port))
            if block.tag == "serve":
                assert server is None, f"{block}: a second server on the page"
                server = _Server(block, code, cwd, env, port, tmp_path / f"server-{block.line}.log")
                continue
            if block.tag == "server-stopped":
                assert server is not None, f"{block}: says the server is stopped, but the page started none"
                server.stop()
            timeout = int(block.tag.split()[1]) * 60 if block.tag.startswith("minutes") else BLOCK_TIMEOUT_S
            proc = subprocess.run(_command(block.language, code), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            assert proc.returncode == 0, f"{block} exits {proc.returncode}:\n{code}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
            ran.append(str(block))
    finally:
        if server is not None:
            server.stop()
    assert ran, f"{page.name}: no block ran"
    # a training run of the walk asked the page's store (a config's own store URL that the port substitution misses
    # would make it a GRPO run with warnings, and exit 0)
    for metrics in sorted((cwd / "runs").glob("*/metrics.jsonl")):
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        asked = [(s["step"], s.get("store_lookups", 0), s.get("store_lookup_failures", 0)) for s in steps if "step" in s]
        assert asked and all(failed == 0 for _, _, failed in asked) and sum(n for _, n, _ in asked) > 0, \
            f"{page.name}: {metrics.parent.name} did not reach the page's store (step, lookups, failures): {asked}"
    # in a checkout the commands leave only what they name (the store, the models laid out, the runs, all ignored by
    # git): their other files go to folders of their own
    left = sorted(p.name for p in cwd.iterdir() if p.name not in ("configs", "data", ".venv", "stores", "models", "runs"))
    assert not left, f"{page.name}'s commands leave {left} in the checkout"


def test_the_readmes_two_commands_are_a_door():
    """README's "Two commands" says what each command does, how long it takes and on what, in a few lines (as TRL's and
    DuckDB's READMEs do); the installs, the timings with their CPU and date live in docs/demo.md, every figure kept."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Two commands\n", 1)[1].split("\n## ", 1)[0]
    prose = [line for line in section.split("```")[-1].splitlines() if line.strip()]
    assert len(prose) <= 6, prose
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|Xeon|AVX|passed in", section), section
    assert "docs/demo.md#the-two-commands" in section
    demo = (REPO_ROOT / "docs" / "demo.md").read_text()
    page = demo.split("## The two commands: what they install and how long they take\n", 1)[1].split("\n## ", 1)[0]
    # each command's time, with the machine and the date it was measured on
    for figure in (r"`make demo`[^.]* took \d+ s", r"\d+ passed in [\d.]+ minutes", r"2-core Intel Xeon", r"\b20\d\d-\d\d-\d\d\b"):
        assert re.search(figure, page), figure
