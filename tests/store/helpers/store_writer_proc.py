"""A generator-like writer process for the store tests: writes shards in a loop, logs each closed shard.

python store_writer_proc.py ROOT MODEL SHARDS GROUPS_PER_SHARD DONE_LOG [PROMPT_OFFSET]
Each line of DONE_LOG is "<shard path> <group id> <group id> ..." written after write_groups returned.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from store_factory import make_group  # noqa: E402

from graft.services.store_api.local.shards import write_groups  # noqa: E402


def main() -> None:
    root, model, shards, per_shard, done_log = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    offset = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    for shard in range(shards):
        groups = [make_group(offset + shard * per_shard + i, model, step=shard, size=8, tokens=64) for i in range(per_shard)]
        path = write_groups(root, groups)
        with open(done_log, "a") as log:
            log.write(" ".join([str(path)] + [g.group_id for g in groups]) + "\n")
            log.flush()


if __name__ == "__main__":
    main()
