"""Files and folders that processes hand each other (docs/style.md, rule 6): written under a temporary name beside the
final one, fsynced, then renamed, so a reader never sees a partial one. Every writer outside the store uses
these; the store's shards have their own writer (`services/store_api/local/shards.py`: page-cache handling)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson


def write_text_atomic(path: Path, text: str, durable: bool = True) -> Path:
    """`text` into `path`, whole or not at all; durable: fsync before the rename (results), not for the
    progress and timing notes that are rewritten often and cost nothing to lose."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> Path:
    """One JSON object per line (orjson), durable and atomic as `write_text_atomic`."""
    return write_text_atomic(path, "".join(orjson.dumps(row).decode() + "\n" for row in rows))


@contextlib.contextmanager
def staged_directory(target: Path, replace: bool) -> Iterator[Path]:
    """A temporary folder beside `target` to build it in; when the block ends without error, its files are
    fsynced and it is renamed to `target`, so a crash never leaves half a folder under the final name.

    replace: an existing `target` is replaced (a checkpoint written again); otherwise the folder that is
    already there wins (a cache another process filled first) and this one is dropped.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        for f in staging.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if target.exists():
            if not replace:
                return
            shutil.rmtree(target)
        try:
            os.rename(staging, target)
        except OSError:
            if replace or not target.exists():  # not a lost race with another process filling the same cache
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
