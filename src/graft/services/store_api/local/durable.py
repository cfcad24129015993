"""How a file appears in the store, and leaves the writer's page cache: temporary file, fsync, rename.

Owns where unfinished files live: `<root>/.tmp/`, on the store's file system but outside `rollouts/` and
`prompts/`, so no reader's glob (`rollouts/*/*.parquet`, `rollouts/**`, a pandas or polars directory read)
ever meets a partial file, even one a killed writer left behind; then the atomic publish (rename into place,
directory fsynced), and dropping written pages. Shards and problem files (`shards.py`) are written through
here; lookup files (`lookup/`), which no outside reader reads, keep a `.tmp-` name in their own directory.

Written files leave the writer's page cache (`drop_cached_pages`, once their data is on disk): a writer
streams ~6 KB per rollout (shard + lookup file) that it never reads again, and on the VM this was measured
on, page cache grown beyond the guest's recently used memory cost 14-18 us of kernel time per 4 KB page
against ~1 us for recycled pages (`benchmarks/RESULTS.md`, Store): at 1M rollouts that was 15 us per
rollout. Dropping recycles the same pages shard after shard. The store reads a lookup file's groups from disk
when first asked for (~0.15 ms per group here; a batch's reads are issued together, see
`lookup.ShardReader.messages`), and the page cache keeps what lookups read.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

TMP_DIR = ".tmp"  # <root>/.tmp/: writers' unfinished files
TMP_PREFIX = ".tmp-"  # lookup files' temporary names; also what earlier writers left next to shards
HAS_FADVISE = hasattr(os, "posix_fadvise")  # Linux; elsewhere pages are not dropped and the page cache just grows
log = logging.getLogger(__name__)


def drop_cached_pages(fd: int) -> None:
    """Tell the kernel a file's pages will not be read soon: clean ones leave the page cache, so the memory is
    reused for the next file instead of growing the cache (see the module docstring); on Linux, dirty ones
    start being written back (without waiting), so a later fsync waits less. Only an optimisation: a failure
    is logged, never raised."""
    if not HAS_FADVISE:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        log.warning("could not drop cached pages of fd %d: %s", fd, exc)


def sync_and_drop(fd: int, data_only: bool = False) -> None:
    """Wait until the file's data is on disk (fsync, or fdatasync where only the data matters), then drop its
    pages from the page cache: dirty pages cannot be dropped."""
    (os.fdatasync if data_only and hasattr(os, "fdatasync") else os.fsync)(fd)
    drop_cached_pages(fd)


def drop_written_pages(path: Path) -> None:
    """Free the pages of a derived file this process will not read again (a lookup file): wait for its data,
    then drop them. A file deleted meanwhile is fine (its pages went with it), and a failure is logged, not
    raised: the file can be rebuilt from its shard, so it must never fail a shard write."""
    if not HAS_FADVISE:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        sync_and_drop(fd, data_only=True)
    except OSError as exc:
        log.warning("could not write back %s before dropping its pages: %s", path, exc)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Pending:
    """A finished, fsynced file in `<root>/.tmp/`, to be renamed to `final` by `publish`."""

    tmp: Path
    final: Path


def store_root(final: Path) -> Path:
    """The store root of a file at <root>/<kind>/<partition>/<name> (rollouts/model=m, prompts/dataset=d)."""
    return final.parents[2]


def write_temporary(final: Path, write, root: Path | None = None) -> Pending:
    """Write through `write(path)` to a file in `<root>/.tmp/`, fsync it, and drop its pages from the page cache
    (durable, so clean: readers read it from disk). `final`'s directory is made only when it is published.
    `root` defaults to the root of a file at <root>/<kind>/<partition>/<name>."""
    directory = (store_root(final) if root is None else root) / TMP_DIR
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{final.parent.name}--{final.name}.{uuid.uuid4().hex[:8]}"
    try:
        write(str(tmp))  # a path, not a Python file object: Arrow's native file is ~3x faster for many small pages
        fd = os.open(tmp, os.O_RDONLY)
        try:
            sync_and_drop(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Pending(tmp, final)


def publish(pending: Pending) -> Path:
    """Rename a finished temporary file to its final name (atomic) and make the rename durable."""
    pending.final.parent.mkdir(parents=True, exist_ok=True)
    os.rename(pending.tmp, pending.final)
    fsync_directory(pending.final.parent)
    return pending.final


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

