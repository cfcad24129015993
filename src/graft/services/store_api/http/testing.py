"""A store server for tests (as fastapi.testclient is FastAPI's): `StoreServer` runs `graft-store serve` from this
checkout (REPO_ROOT) as a subprocess on a loopback port, for the store's and the trainer's tests, benchmarks and the
demo. Nothing in the served store imports it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SOURCE_ROOT = Path(__file__).resolve().parents[4]  # the folder holding graft/: the checkout's src/
REPO_ROOT = SOURCE_ROOT.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StoreServer:
    """A store server over `root` on 127.0.0.1; restartable on the same port (`stop()`/`kill()`, `start()`).

    `env` adds GRAFT_STORE_* settings (e.g. {"GRAFT_STORE_COMPACT_INTERVAL_S": "1"}). The server's log is
    appended to <root>/logs/server.log.
    """

    def __init__(self, root: Path, port: int | None = None, token: str | None = None,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 60.0):
        self.root = Path(root)
        self.port = port or free_port()
        self.token = token
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "logs" / "server.log"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> StoreServer:
        if self.process is not None and self.process.poll() is None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRAFT_STORE_")}
        env.update({"GRAFT_STORE_ROOT": str(self.root), "GRAFT_STORE_HOST": "127.0.0.1", "GRAFT_STORE_PORT": str(self.port)})
        if self.token:
            env["GRAFT_STORE_TOKEN"] = self.token
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH")) if p)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "graft.services.store_api.cli", "serve"], env=env, cwd=REPO_ROOT,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.kill()  # never leave a half-started server holding the index
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"store server exited with {self.process.returncode} at startup:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"store server not healthy after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful stop (SIGTERM: the index is checkpointed and closed); SIGKILL if it hangs."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """Crash it (SIGKILL), as a machine failure would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
