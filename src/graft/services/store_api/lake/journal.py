"""The broker's journal in a lake (`LakeJournal`): wanted prompts and the served ledger shared by every replica.

A DuckLake table `broker_journal (writer, record)`: one JSON record a row, as the local journal's lines
(broker/journal.py). An append is one lake transaction (committed to the catalog, its data file written, before the
call returns: a lake's durability, as a commit of groups has). Each replica applies its own records at once and
follows the others' through the table's change feed (`read_new`, from the broker's poll: records of other writers
since the last snapshot read, in commit order). A rewrite (the broker compacting the journal to its state) deletes
every row and inserts the state in one transaction; a follower that meets deletions in its window reads the whole
table again (`read_new` answers None). Replicas' states agree once each has followed the others (a want recorded at
two replicas counts its misses at both; clearing or evicting a want twice is a no-op).
"""

from __future__ import annotations

import time
import uuid

import duckdb
import orjson
import pyarrow as pa

from graft.services.store_api.lake.connection import ALIAS
from graft.services.store_api.lake.lake import Lake

TABLE = "broker_journal"
ATTEMPTS = 8  # commits that lose to another writer's are tried again (DuckLake settles appends, not every conflict)


class LakeJournal:
    """The broker's journal as a lake table; `path` names it in messages."""

    def __init__(self, lake: Lake):
        self.lake = lake
        self.writer = uuid.uuid4().hex  # this replica's records, not applied twice when followed back
        self.read_upto = -1  # the snapshot the records read so far are of
        self.path = f"{lake.config.describe()}: table {TABLE}"

    def _ensure(self, con: duckdb.DuckDBPyConnection) -> None:
        con.execute(f"CREATE TABLE IF NOT EXISTS {ALIAS}.{TABLE} (writer VARCHAR NOT NULL, record VARCHAR NOT NULL)")

    def read(self) -> list[dict]:
        """Every record, in commit order."""
        def work(con):
            self._ensure(con)
            snapshot = int(con.execute(f"SELECT id FROM {ALIAS}.current_snapshot()").fetchall()[0][0])
            rows = con.execute(f"SELECT record FROM {ALIAS}.{TABLE} AT (VERSION => ?) ORDER BY rowid",
                               [snapshot]).fetchall()
            return snapshot, [orjson.loads(r) for (r,) in rows]

        self.read_upto, records = self.lake.connection.run("read the broker journal of", work)
        return records

    def read_new(self) -> list[dict] | None:
        """Other writers' records committed since the last read, in commit order; None when the journal was rewritten
        meanwhile (or the feed no longer reaches back that far): read() it whole again."""
        def work(con):
            snapshot = int(con.execute(f"SELECT id FROM {ALIAS}.current_snapshot()").fetchall()[0][0])
            if snapshot == self.read_upto:
                return snapshot, []
            try:
                rows = con.execute(f"""
                    SELECT change_type, writer, record FROM {ALIAS}.table_changes('{TABLE}', ?, ?)
                    ORDER BY snapshot_id, rowid""", [self.read_upto + 1, snapshot]).fetchall()
            except (duckdb.InvalidInputException, duckdb.CatalogException):  # snapshots expired, or no table yet
                return snapshot, None
            if any(kind != "insert" for kind, _, _ in rows):
                return snapshot, None
            return snapshot, [orjson.loads(r) for _, writer, r in rows if writer != self.writer]

        snapshot, records = self.lake.connection.run("follow the broker journal of", work)
        if records is not None:
            self.read_upto = snapshot
        return records

    def append(self, records: list[dict]) -> None:
        """Commit the records (in one transaction)."""
        self._commit(records, replace=False)

    def rewrite(self, records: list[dict]) -> None:
        """Replace every record with these (in one transaction)."""
        self._commit(records, replace=True)

    def _commit(self, records: list[dict], replace: bool) -> None:
        rows = pa.table({"writer": [self.writer] * len(records), "record": [orjson.dumps(r).decode() for r in records]})
        if not rows.num_rows and not replace:
            return

        def work(con):
            for attempt in range(ATTEMPTS):
                try:
                    con.execute("BEGIN")
                    if replace:
                        con.execute(f"DELETE FROM {ALIAS}.{TABLE}")
                    con.register("broker_fresh", rows)
                    con.execute(f"INSERT INTO {ALIAS}.{TABLE} SELECT writer, record FROM broker_fresh")
                    con.execute("COMMIT")
                    return
                except duckdb.TransactionException:
                    con.execute("ROLLBACK")
                    if attempt == ATTEMPTS - 1:
                        raise
                    time.sleep(0.05 * 2 ** attempt)
                except BaseException:
                    try:
                        con.execute("ROLLBACK")
                    except duckdb.Error:
                        pass
                    raise
                finally:
                    con.unregister("broker_fresh")

        self.lake.connection.run("write the broker journal of", work)

    def close(self) -> None:
        """Nothing of its own: the replica closes the lake."""
