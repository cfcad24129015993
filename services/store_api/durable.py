"""How a file appears in the store, and leaves the writer's page cache: temporary name, fsync, rename.

Owns the `.tmp-` convention every writer follows (readers and the store's scanner never pick up such a
name), the atomic publish, and dropping written pages. Shards (`shards.py`), problem files and lookup files
(`lookup.py`) are all written through here.

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
from pathlib import Path

TMP_PREFIX = ".tmp-"
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


def write_temporary(directory: Path, write, name: str) -> Path:
    """Write through `write(path)` to a `.tmp-` name in `directory`, fsync, and drop its pages from the page
    cache (durable, so clean: readers read it from disk); readers never pick up a `.tmp-` name."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (TMP_PREFIX + name)
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
    return tmp


def publish(tmp: Path) -> Path:
    """Rename a finished temporary file to its final name (atomic) and make the rename durable."""
    final = tmp.with_name(tmp.name.removeprefix(TMP_PREFIX))
    os.rename(tmp, final)
    dir_fd = os.open(tmp.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final

