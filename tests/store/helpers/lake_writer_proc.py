"""A writer process for the lake tests: commits batches of groups to the lake in GRAFT_LAKE_* (one transaction
per batch) and logs each step.

python lake_writer_proc.py MODEL BATCHES GROUPS_PER_BATCH LOG [PROMPT_OFFSET]
LOG gets "begin <k>" before batch k's commit and "done <k> <group id>..." after it returned.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from store_factory import make_group, make_problem  # noqa: E402

from graft.services.store_api.lake.config import LakeConfig  # noqa: E402
from graft.services.store_api.lake.lake import Lake  # noqa: E402
from graft.services.store_api.tables import groups_table, validate_table  # noqa: E402


def main() -> None:
    model, batches, per_batch, log_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    offset = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    with Lake(LakeConfig()) as lake, open(log_path, "a", buffering=1) as log:
        for batch in range(batches):
            first = offset + batch * per_batch
            groups = [make_group(first + i, model, step=batch, size=8, tokens=64) for i in range(per_batch)]
            problems = [make_problem(first + i) for i in range(per_batch)]
            table = validate_table(groups_table(groups))
            log.write(f"begin {batch}\n")
            lake.writing.commit(table, problems)
            log.write(" ".join(["done", str(batch)] + [g.group_id for g in groups]) + "\n")


if __name__ == "__main__":
    main()
