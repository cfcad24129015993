"""A lake's maintenance (`graft-store compact --backend lake`): DuckLake's merges, snapshot expiry, file cleanup."""

from __future__ import annotations

from graft.services.store_api.lake.connection import ALIAS, LakeConnection


class LakeMaintenance:
    """Merging small files, expiring old snapshots, deleting files nothing references (a part of `Lake`)."""

    def __init__(self, connection: LakeConnection):
        self.connection = connection

    def maintain(self, expire_older_than_s: float, cleanup_older_than_s: float) -> dict[str, int]:
        """DuckLake's maintenance: merge adjacent small files (row ids and snapshot ids kept, so followers see
        nothing new), expire snapshots older than `expire_older_than_s`, delete files scheduled for deletion
        and orphaned files (left by writers killed mid-commit) older than `cleanup_older_than_s`."""
        def work(con):
            before = con.execute(f"SELECT count(*) FROM ducklake_list_files('{ALIAS}', 'rollouts')").fetchall()[0][0]
            con.execute(f"CALL ducklake_merge_adjacent_files('{ALIAS}')")
            after = con.execute(f"SELECT count(*) FROM ducklake_list_files('{ALIAS}', 'rollouts')").fetchall()[0][0]
            expire_before = _interval_ago(expire_older_than_s)
            expired = con.execute(f"SELECT count(*) FROM ducklake_expire_snapshots('{ALIAS}', "
                                  f"older_than => {expire_before})").fetchall()[0][0]
            cleanup_before = _interval_ago(cleanup_older_than_s)
            deleted = con.execute(f"SELECT count(*) FROM ducklake_cleanup_old_files('{ALIAS}', "
                                  f"older_than => {cleanup_before})").fetchall()[0][0]
            orphans = con.execute(
                f"SELECT count(*) FROM ducklake_delete_orphaned_files('{ALIAS}', older_than => {cleanup_before})"
            ).fetchall()[0][0]
            return {"files_before": int(before), "files_after": int(after), "snapshots_expired": int(expired),
                    "files_deleted": int(deleted), "orphans_deleted": int(orphans)}

        return self.connection.run("maintain", work)


def _interval_ago(seconds: float) -> str:
    return f"now() - INTERVAL '{max(0.0, float(seconds)):.6f} seconds'"
