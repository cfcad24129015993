"""`graft-store migrate`: copy a store from a local root into a lake, or from a lake into a local root.

Both directions keep the order groups were stored in (a local store's shards by name, which starts with their
UTC creation time; a lake's rows by row id, which is commit order), keep the first copy of a group met twice
(as the store's index does), and skip what the target already holds: running a migration again adds
nothing, and root -> lake -> root gives back the same rows and problems.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from graft.schemas import PROBLEM_ARROW_SCHEMA, Problem
from graft.services.store_api.lake.lake import Lake
from graft.services.store_api.lake.reading import first_copies
from graft.services.store_api.local import model_dir, row_group_plan, write_problems, write_rollout_table
from graft.services.store_api.tables import ShardValidationError, group_runs, validate_problems, validate_table

log = logging.getLogger("graft.store.migrate")

BATCH_ROLLOUTS = 8192  # rollouts per lake commit and per written shard
SHARDS = "part-*.parquet"  # final names of shards and problem files (writers' temporary names start with .tmp-)


def local_shards(root: Path) -> list[Path]:
    """A local store's rollout shards, oldest first (the order its index met them)."""
    return sorted((Path(root) / "rollouts").glob(f"model=*/{SHARDS}"), key=lambda p: p.name)


def local_problems(root: Path) -> list[Problem]:
    """A local store's problems, first copy of each (dataset, prompt id) kept."""
    found: dict[tuple[str, str], Problem] = {}
    for path in sorted((Path(root) / "prompts").glob(f"dataset=*/{SHARDS}"), key=lambda p: p.name):
        for row in pq.read_table(path).cast(PROBLEM_ARROW_SCHEMA).to_pylist():
            found.setdefault((row["dataset"], row["prompt_id"]), Problem(**row))
    return list(found.values())


def local_group_ids(root: Path) -> set[str]:
    ids: set[str] = set()
    for shard in local_shards(root):
        ids.update(pc.unique(pq.read_table(shard, columns=["group_id"]).column("group_id")).to_pylist())
    return ids


def _new_groups(table: pa.Table, seen: set[str]) -> tuple[pa.Table, int]:
    """The table without the groups in `seen`, and how many it dropped; adds its own groups to `seen`."""
    starts, _ = group_runs(table.column("group_id"))
    ids = table.column("group_id").take(pa.array(starts)).to_pylist()
    old = [g for g in ids if g in seen]
    seen.update(ids)
    if not old:
        return table, 0
    return table.filter(pc.invert(pc.is_in(table.column("group_id"), pa.array(old)))), len(old)


def local_to_lake(root: Path, lake: Lake, progress: bool = True) -> dict[str, int]:
    """Commit a local store's groups (batches of about BATCH_ROLLOUTS rollouts, one transaction each) and problems
    to the lake. Shards that fail validation are reported and skipped."""
    report = {"shards": 0, "groups": 0, "rollouts": 0, "duplicate_groups": 0, "problems": 0, "skipped_shards": 0}
    seen: set[str] = set()
    pending: list[pa.Table] = []

    def commit() -> None:
        if pending:
            result = lake.writing.commit(pa.concat_tables(pending))
            report["groups"] += result.accepted_groups
            report["rollouts"] += result.rollouts
            report["duplicate_groups"] += len(result.duplicate_groups)
            pending.clear()

    shards = local_shards(root)
    for shard in tqdm(shards, desc="migrate shards", unit="shard", disable=not progress):
        try:
            table, dropped = _new_groups(validate_table(pq.read_table(shard)), seen)
        except (OSError, pa.ArrowException, ShardValidationError) as exc:
            log.error("skipped %s: %s", shard, exc)
            report["skipped_shards"] += 1
            continue
        report["shards"] += 1
        report["duplicate_groups"] += dropped
        pending.append(table)
        if sum(t.num_rows for t in pending) >= BATCH_ROLLOUTS:
            commit()
    commit()
    problems = local_problems(root)
    if problems:
        report["problems"] = lake.writing.commit(None, problems).problems_added
    return report


def lake_to_local(lake: Lake, root: Path, progress: bool = True) -> dict[str, int]:
    """Write the lake's groups (at its newest snapshot) as shards of one model each and its problems under a
    local store root; groups the root already holds are skipped."""
    root = Path(root)
    report = {"groups": 0, "rollouts": 0, "duplicate_groups": 0, "problems": 0, "shards": 0}
    seen = local_group_ids(root)
    snapshot = lake.reading.snapshot()
    with tqdm(desc="migrate snapshots", total=snapshot.id, unit="snapshot", disable=not progress) as bar:
        for upto, rows in lake.reading.iter_rollouts(-1, snapshot.id):
            bar.n = upto
            bar.refresh()
            # a group committed twice (writers racing) keeps its first copy, as a replica's cache
            rows, left_out = first_copies(rows, seen)
            report["duplicate_groups"] += left_out.num_rows
            if not rows.num_rows:
                continue
            table = validate_table(rows.drop_columns(["rowid", "snapshot_id"]))
            seen.update(pc.unique(table.column("group_id")).to_pylist())
            for model in pc.unique(table.column("model_id")).to_pylist():
                of_model = table.filter(pc.equal(table.column("model_id"), model))
                _, lengths = group_runs(of_model.column("group_id"))
                offset = 0
                for rows_in_shard in row_group_plan(lengths, BATCH_ROLLOUTS):
                    write_rollout_table(model_dir(root, model), of_model.slice(offset, rows_in_shard))
                    offset += rows_in_shard
                    report["shards"] += 1
            report["groups"] += len(group_runs(table.column("group_id"))[0])
            report["rollouts"] += table.num_rows
    problems = lake.reading.problems_between(-1, snapshot.id)
    if problems.num_rows:
        known = {(p.dataset, p.prompt_id) for p in local_problems(root)}
        fresh = [p for p in validate_problems(problems) if (p.dataset, p.prompt_id) not in known]
        if fresh:
            write_problems(root, fresh)
        report["problems"] = len(fresh)
    return report
