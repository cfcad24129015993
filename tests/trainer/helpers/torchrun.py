"""Start N ranks under torchrun (CPU, gloo) the way a user does, for the data-parallel tests; a timeout kills the
whole process group, so that a collective that hangs fails the test instead of blocking the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def torchrun(target: list[str], timeout_s: float = 300.0, nproc: int = 2, python: str | Path = sys.executable) -> str:
    """`torchrun --standalone --nproc-per-node N TARGET...` (TARGET: a script and its arguments, or -m MODULE ...)
    with `python` (another environment's: .venv-vllm); returns the ranks' output. Fails the test when a rank fails
    or the job outlives `timeout_s`."""
    environment = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}:{Path(__file__).parent}", HF_HUB_OFFLINE="1",
                       OMP_NUM_THREADS="1")
    command = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *target]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{nproc} ranks of {' '.join(target)} did not finish in {timeout_s:.0f} s (a collective hangs?):\n"
                    f"{output[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{output[-6000:]}"
    return output
