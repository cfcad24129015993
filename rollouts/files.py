"""Files the demo's processes hand each other: written under a temporary name, then renamed, so a reader
never sees a partial one."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    """`text` into `path`, whole or not at all; durable: fsync before the rename (results), not for the
    progress and timing notes that are rewritten often and cost nothing to lose."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
