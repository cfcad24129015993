"""Real lake services on loopback for the tests and the benchmark: a throwaway PostgreSQL and moto's S3 server.

PostgreSQL is the server Debian packages (`apt-get install postgresql`; its binaries live under
/usr/lib/postgresql/<version>/bin), run from a temporary directory on a free loopback port. initdb and
postgres refuse to run as root: as root, they run as the system user `graft-pg` (created when missing).
moto's S3 server (`moto[server]`) runs in this process (ThreadedMotoServer) or as a subprocess (the
benchmark: its request handling then does not compete with the benchmark's own threads for the GIL).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PG_USER = "graft-pg"  # the system user that runs PostgreSQL when the tests run as root
PG_SUPERUSER_PASSWORD = "graft-superuser"
LAKE_ROLE = "graft"
LAKE_ROLE_PASSWORD = "graft-lake"
S3_KEY_ID = "graft-test-key"
S3_SECRET = "graft-test-secret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin_dir() -> Path:
    """Debian's PostgreSQL server binaries (the newest installed version), or GRAFT_PG_BIN."""
    if os.environ.get("GRAFT_PG_BIN"):
        return Path(os.environ["GRAFT_PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    if not found:
        raise RuntimeError("PostgreSQL's server binaries are not installed (no /usr/lib/postgresql/*/bin/initdb): "
                           "apt-get install -y postgresql (.ci/run does), or set GRAFT_PG_BIN")
    return found[-1].parent


class PostgresServer:
    """A PostgreSQL cluster in a temporary directory on 127.0.0.1, with a role `graft` owning the databases
    that `create_database` makes. `stop()` keeps the data (start() again on the same port); `close()` removes it."""

    def __init__(self, port: int | None = None):
        self.bin = postgres_bin_dir()
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="graft-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.run_as = None
        if os.geteuid() == 0:
            self.run_as = _system_user(PG_USER)
            os.chown(self.dir, self.run_as.pw_uid, self.run_as.pw_gid)
        self._initdb()

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        kwargs = {}
        if self.run_as is not None:
            kwargs = {"user": self.run_as.pw_uid, "group": self.run_as.pw_gid, "extra_groups": []}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(self.dir)}
        result = subprocess.run(cmd, cwd=self.dir, env=env, capture_output=True, text=True, **kwargs)
        if check and result.returncode:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed ({result.returncode}): {result.stderr or result.stdout}"
                               f"\n{self.log_tail()}")
        return result

    def _initdb(self) -> None:
        password_file = self.dir / "superuser-password"
        password_file.write_text(PG_SUPERUSER_PASSWORD + "\n")
        if self.run_as is not None:
            os.chown(password_file, self.run_as.pw_uid, self.run_as.pw_gid)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", f"--pwfile={password_file}",
                  "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C")
        password_file.unlink()
        with open(self.data / "postgresql.conf", "a") as conf:
            # loopback only; the socket in the cluster's own directory; no fsync: a test cluster, not a store
            conf.write(f"\nlisten_addresses = '127.0.0.1'\nport = {self.port}\nunix_socket_directories = '{self.dir}'\n"
                       "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n")

    def start(self) -> PostgresServer:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")
        if not getattr(self, "_role_made", False):
            self.sql(f"CREATE ROLE {LAKE_ROLE} LOGIN PASSWORD '{LAKE_ROLE_PASSWORD}'")
            self._role_made = True
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`immediate`: as a crash would); its data stays for start()."""
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    def sql(self, statement: str, database: str = "postgres") -> str:
        env = {**os.environ, "PGPASSWORD": PG_SUPERUSER_PASSWORD}
        result = subprocess.run([str(self.bin / "psql"), "-X", "-q", "-t", "-A", "-h", "127.0.0.1", "-p", str(self.port),
                                 "-U", "postgres", "-d", database, "-v", "ON_ERROR_STOP=1", "-c", statement],
                                env=env, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"psql {statement!r} failed: {result.stderr}")
        return result.stdout

    def create_database(self, name: str) -> str:
        """A new database owned by the lake role; returns its libpq connection string."""
        self.sql(f'CREATE DATABASE "{name}" OWNER {LAKE_ROLE}')
        return self.dsn(name)

    def dsn(self, database: str, password: str = LAKE_ROLE_PASSWORD) -> str:
        return f"dbname={database} host=127.0.0.1 port={self.port} user={LAKE_ROLE} password={password}"

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except (FileNotFoundError, PermissionError):
            return "(no postgres log)"

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _system_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                       capture_output=True)
        return pwd.getpwnam(name)


class MotoS3:
    """moto's S3 server on 127.0.0.1 with one bucket; `stop()` and `start()` again keep the objects when it runs
    in this process (moto's backend is process-global)."""

    def __init__(self, bucket: str = "graft-lake", port: int | None = None, in_process: bool = True):
        self.bucket = bucket
        self.port = port or free_port()
        self.in_process = in_process
        self._server = None
        self._process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The server's process (this one when it runs in-process)."""
        return self._process.pid if self._process is not None else os.getpid()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The usual AWS variables that point a lake at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": S3_KEY_ID, "AWS_SECRET_ACCESS_KEY": S3_SECRET,
                "AWS_REGION": "us-east-1"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY_ID,
                            aws_secret_access_key=S3_SECRET, region_name="us-east-1")

    def start(self) -> MotoS3:
        if self.in_process:
            from moto.server import ThreadedMotoServer

            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            self._server.start()
        else:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self._wait_up()
        client = self.client()
        if self.bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=self.bucket)
        return self

    def _wait_up(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if self._process is not None and self._process.poll() is not None:
                    raise RuntimeError(f"moto's server exited with {self._process.returncode}")
                time.sleep(0.05)
        raise RuntimeError(f"moto's server not up on port {self.port} after {timeout_s} s")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._process is not None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def objects(self, prefix: str = "") -> list[str]:
        keys, token = [], None
        client = self.client()
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = client.list_objects_v2(**kwargs)
            keys += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            token = page["NextContinuationToken"]

    def __enter__(self) -> MotoS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
