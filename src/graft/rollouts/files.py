"""Files and folders that processes hand each other (docs/style.md, rule 6): written under a temporary name beside the
final one, fsynced, then renamed, so a reader never sees a partial one. Every writer outside the store uses
these; the store's shards have their own writer (`services/store_api/local/shards.py`: page-cache handling)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
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


# A trainer's checkpoints, which graft-train resumes from and graft-generate reloads (watch_dir): <run_dir>/checkpoints/
# step_000010/, each renamed into place whole (a final name is a complete checkpoint)
CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(checkpoint: Path) -> int:
    """The policy step of a checkpoint folder, from its name (step_000010: 10)."""
    match = CHECKPOINT_NAME.match(Path(checkpoint).name)
    if match is None:
        raise ValueError(f"{checkpoint} is not a checkpoint folder (step_<N>)")
    return int(match.group(1))


def has_weights(checkpoint: Path) -> bool:
    """Whether a checkpoint holds an HF export (config.json beside the weights), what a sampler loads."""
    return (checkpoint / "config.json").exists()


def list_checkpoints(folder: Path, complete: Callable[[Path], bool] = has_weights) -> list[Path]:
    """The checkpoints in `folder` that `complete` accepts, in the order they were written, oldest first: by the
    folder's modification time (the trainer sets it as it renames one into place), then by step, so that a run started
    over in the same folder does not lose its steps to the earlier run's higher ones."""
    if not Path(folder).is_dir():
        return []
    found = [p for p in Path(folder).iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name) and complete(p)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, checkpoint_step(p)))


def latest_checkpoint(folder: Path, complete: Callable[[Path], bool] = has_weights) -> Path | None:
    """The checkpoint in `folder` written last that `complete` accepts (what --resume continues from, what a generator
    following a trainer reloads), or None."""
    checkpoints = list_checkpoints(folder, complete)
    return checkpoints[-1] if checkpoints else None
