"""The broker's durable journal on a store root: `<root>/broker/journal.jsonl`, one JSON record a line.

The same promise as a shard: an append is written and fdatasynced before the call that made it returns (a want, a
ledger entry acknowledged is on disk, however many writes it takes); a rewrite (compaction to the current state) goes to a temporary file, is
fsynced and renamed over the journal, so a reader meets the old journal or the new one, never half of one. A crash in
the middle of an append leaves at most a torn last line: `read` cuts the journal back to its last whole record (the
torn one was never acknowledged). A damaged line inside the journal (a disk fault) is not skipped silently: the
journal is cut there, and what followed it is kept beside it as `journal.jsonl.damaged-<time>` and logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import orjson

from graft.services.store_api.local import fsync_directory, publish, write_temporary

log = logging.getLogger("graft.store")


class Journal:
    """Append-only JSON lines with fsync, and an atomic rewrite; thread-safe."""

    writer = "root"  # the one writer of a store root's journal: every record is its own

    def __init__(self, directory: Path, store_root: Path):
        self.path = directory / "journal.jsonl"
        self.store_root = store_root
        self._lock = threading.Lock()
        self._fd: int | None = None

    def read(self) -> list[dict]:
        """Every whole record, oldest first; cuts a torn or damaged tail off first (see the module docstring)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.exists() else b""
        records, good_end = [], 0
        for line in data.splitlines(keepends=True):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline: a torn append")
                record = orjson.loads(line)
                if not isinstance(record, dict) or "k" not in record:
                    raise ValueError("not a journal record")
            except ValueError as exc:
                rest = data[good_end:]
                if good_end + len(line) < len(data):  # whole records follow: damage, not a torn append
                    aside = self.path.with_name(f"{self.path.name}.damaged-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}")
                    aside.write_bytes(rest)
                    log.error("broker journal %s: line %d is damaged (%s); cut there, the %d bytes from it on kept in %s",
                              self.path, len(records) + 1, exc, len(rest), aside)
                else:
                    log.warning("broker journal %s: dropped a torn last record (%d bytes) a crash left", self.path, len(rest))
                with open(self.path, "r+b") as f:
                    f.truncate(good_end)
                    os.fsync(f.fileno())
                break
            records.append(record)
            good_end += len(line)
        return records

    def read_new(self) -> list[dict]:
        """Records other writers added since the last read: none (the store process is this file's one writer)."""
        return []

    def append(self, records: Iterable[dict]) -> None:
        """Write the records at the end and wait until they are on disk."""
        data = b"".join(orjson.dumps(r) + b"\n" for r in records)
        if not data:
            return
        with self._lock:
            fd = self._open()
            view = memoryview(data)
            while view:  # os.write may write less than it was given (a signal, a full pipe, a quota): write the rest
                view = view[os.write(fd, view):]
            os.fdatasync(fd)

    def rewrite(self, records: Iterable[dict]) -> None:
        """Replace the journal with these records (the current state), atomically."""
        data = b"".join(orjson.dumps(r) + b"\n" for r in records)
        with self._lock:
            pending = write_temporary(self.path, lambda tmp: Path(tmp).write_bytes(data), root=self.store_root)
            publish(pending)
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if fresh:
                fsync_directory(self.path.parent)
        return self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
