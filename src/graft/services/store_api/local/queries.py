"""What the index answers: peer, prompt and group lookups (from the mirror), filtered rollout pages and
stats (from DuckDB), and the reads of the chosen groups' rows: a part of `StoreIndex` (index.py), reading
through the catalog's methods.

Everything the API serves from the index goes through here; nothing here changes the index except
`read_selected` quarantining a shard it finds damaged.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from graft.schemas import ROLLOUT_ARROW_SCHEMA, ModelStats, PeerLookupRequest, StatsResponse
from graft.schemas.rollout import INT64_MAX
from graft.services.store_api.local.catalog import Catalog
from graft.services.store_api.local.lookup import ShardReadError
from graft.services.store_api.local.mirror import GroupRef


def us_to_datetime(us: int | None) -> datetime | None:
    return None if us is None else datetime.fromtimestamp(us / 1e6, tz=timezone.utc)


class BadCursor(ValueError):
    """A `cursor` that this store did not hand out."""


def encode_cursor(seq: int, row: int) -> str:
    return base64.urlsafe_b64encode(f"{seq}:{row}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, int]:
    try:
        seq_text, row_text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().split(":")
        seq, row = int(seq_text), int(row_text)
    except (ValueError, UnicodeDecodeError, binascii.Error) as exc:
        raise BadCursor(f"cursor {cursor!r} is not one this store handed out: pass next_cursor unchanged") from exc
    if not (0 <= seq <= INT64_MAX and 0 <= row <= INT64_MAX):
        raise BadCursor(f"cursor {cursor!r} is not one this store handed out: pass next_cursor unchanged")
    return seq, row


class IndexQueries:
    """The read side of StoreIndex: lookups, pages, stats. It holds no state of its own."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    # ------------------------------------------------------------------ lookups (the mirror)

    def select_peer_groups(self, req: PeerLookupRequest,
                           served: Mapping[str, int] | None = None) -> tuple[list[GroupRef], dict[str, str]]:
        """The groups a peer lookup returns (by prompt in request order, in the request's order) and the misses, each
        with why it got nothing (prompt id -> one of graft.schemas.api.MISS_REASONS); `served`: the learner's ledger
        counts (group id -> times), for req.max_times_served and order least_served."""
        return self.catalog.mirror.peer_groups(req, served)

    def select_prompt_groups(self, prompt: str, model: str | None, limit: int) -> list[GroupRef]:
        return self.catalog.mirror.prompt_groups(prompt, model, limit)

    def select_group(self, group_id: str) -> list[GroupRef]:
        return self.catalog.mirror.group(group_id)

    def read_selected(self, select, as_messages: bool = False):
        """Run `select() -> (refs, extra)` and read the refs' rows; on an unreadable shard, quarantine or
        re-resolve (a compacted-away file) and select again. Returns (table, extra), or with `as_messages`
        (one IPC record batch message per group, extra) for `arrow_stream`."""
        reader = self.catalog.reader
        read = reader.messages if as_messages else reader.read
        failed: set[str] = set()
        for attempt in range(5):
            refs, extra = select()
            try:
                return read([(r.file, r.row_start, r.num_rows) for r in refs]), extra
            except ShardReadError as exc:
                if attempt == 4:
                    raise
                rel = exc.path.relative_to(self.catalog.root).as_posix()
                if self._is_retired(rel) or not exc.path.exists():
                    continue  # compacted away meanwhile: the next select() finds the groups' new home
                if rel in failed:  # failed twice from a freshly opened file: really damaged
                    self.catalog.quarantine(rel, f"unreadable at lookup: {exc.reason}")
                failed.add(rel)
        raise AssertionError("unreachable")

    def _is_retired(self, rel: str) -> bool:
        rows = self.catalog.cursor().execute("SELECT retired_us FROM files WHERE path = ?", [rel]).fetchall()
        return not rows or rows[0][0] is not None

    def group_count(self) -> int:
        return len(self.catalog.mirror)


    # ------------------------------------------------------------------ filtered pages (DuckDB)

    def rollout_page(
        self, *, model: str | None = None, prompt_id: str | None = None, dataset: str | None = None,
        correct: bool | None = None, min_reward: float | None = None, max_reward: float | None = None,
        min_policy_step: int | None = None, max_policy_step: int | None = None,
        cursor: str | None = None, limit: int = 100,
    ) -> tuple[pa.Table, str | None]:
        """Rollouts matching the filters in ingest order, `limit` at most, and the cursor of the next page."""
        seq, row = decode_cursor(cursor) if cursor else (0, 0)
        where, params = ["g.seq >= ?"], [seq]
        for clause, value in (("g.model_id = ?", model), ("g.prompt_id = ?", prompt_id), ("g.dataset = ?", dataset),
                              ("g.policy_step >= ?", min_policy_step), ("g.policy_step <= ?", max_policy_step),
                              ("g.max_reward >= ?", min_reward), ("g.min_reward <= ?", max_reward)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if correct is True:
            where.append("g.successes > 0")
        elif correct is False:
            where.append("g.successes < g.group_size")
        sql = f"""SELECT g.seq, f.path, g.row_start, g.num_rows FROM groups g JOIN files f USING (file_id)
                  WHERE {' AND '.join(where)} ORDER BY g.seq LIMIT ?"""
        pieces: list[pa.Table] = []
        taken = scanned = 0
        batch = max(16, min(256, limit // 4 + 1))
        while True:
            def select():
                rows = self.catalog.cursor().execute(sql, params + [batch]).fetchall()
                return [GroupRef("", "", "", 0, 0, 0, 0, s, f, r, n) for s, f, r, n in rows], rows

            table, rows = self.read_selected(select)
            if not rows:
                return _concat(pieces), None
            seqs = np.repeat([r[0] for r in rows], [r[3] for r in rows])  # (rows read,)
            position = np.concatenate([np.arange(r[3]) for r in rows])  # row within its group
            keep = (seqs > seq) | (position >= row)
            if correct is not None:
                keep &= table.column("correct").to_numpy(zero_copy_only=False) == correct
            if min_reward is not None or max_reward is not None:
                reward = table.column("reward")
                ok = pc.is_valid(reward).to_numpy(zero_copy_only=False)
                values = pc.fill_null(reward, 0.0).to_numpy()
                if min_reward is not None:
                    ok &= values >= min_reward
                if max_reward is not None:
                    ok &= values <= max_reward
                keep &= ok
            kept = np.flatnonzero(keep)
            if taken + len(kept) >= limit:
                kept = kept[: limit - taken]
                pieces.append(table.take(pa.array(kept)))
                last = int(kept[-1])
                return _concat(pieces), encode_cursor(int(seqs[last]), int(position[last]) + 1)
            pieces.append(table.take(pa.array(kept)))
            taken += len(kept)
            scanned += len(rows)
            seq, row = rows[-1][0] + 1, 0
            params[0] = seq
            if scanned >= self.catalog.settings.max_scan_groups:
                return _concat(pieces), encode_cursor(seq, 0)

    # ------------------------------------------------------------------ the browser's reads (browser/queries.py)

    def prompt_refs(self, prompt_id: str) -> list[GroupRef]:
        """Every group of a prompt, most recent first (from the mirror: no DuckDB query)."""
        return self.catalog.mirror.prompt_groups(prompt_id, None, INT64_MAX)

    def prompts_before(self, before: int, span: int) -> list[tuple[int, str, str]]:
        """(newest seq, prompt_id, dataset of that group) of each prompt with groups in before - span <= seq <
        before, newest first. Groups are inserted in seq order, so DuckDB's zonemaps skip the row groups outside
        the range: the cost is the span's, not the table's."""
        return self.catalog.cursor().execute("""
            SELECT max(seq) AS newest, prompt_id, arg_max(dataset, seq) FROM groups WHERE seq >= ? AND seq < ?
            GROUP BY prompt_id ORDER BY newest DESC""", [before - span, before]).fetchall()

    def newest_seq(self) -> int:
        """The seq the next indexed group gets (every group's is below it)."""
        return self.catalog.next_seq

    def groups_after(self, seq: int) -> tuple[list[tuple[int, str, str]], int]:
        """(seq, prompt_id, dataset) of the groups with a seq above `seq`, oldest first, and the number of groups
        indexed, read in one transaction (so a reader that adds the first to what it has can check the second)."""
        cursor = self.catalog.cursor()
        cursor.begin()
        try:
            rows = cursor.execute("SELECT seq, prompt_id, dataset FROM groups WHERE seq > ? ORDER BY seq",
                                  [seq]).fetchall()
            count = cursor.execute("SELECT count(*) FROM groups").fetchall()[0][0]
        finally:
            cursor.commit()
        return rows, count

    def problem_files(self) -> dict[int, str]:
        """file id -> path (relative to the root) of every indexed problems file."""
        return dict(self.catalog.cursor().execute("SELECT file_id, path FROM files WHERE kind = 'prompts'").fetchall())

    def problems_of_file(self, file_id: int) -> set[tuple[str, str]]:
        """The (dataset, prompt id) pairs whose first stored copy is in this problems file."""
        return set(self.catalog.cursor().execute("SELECT dataset, prompt_id FROM problems WHERE file_id = ?",
                                          [file_id]).fetchall())

    def step_bins(self, bins: int) -> tuple[int, list[tuple]]:
        """Policy steps in `bins` bins of equal width: (width, rows of (model, bin, min step, max step, groups,
        rollouts, success rate, informative groups)), by model then bin. Aggregates every group (an overview)."""
        cursor = self.catalog.cursor()
        top = cursor.execute("SELECT coalesce(max(policy_step), 0) FROM groups").fetchall()[0][0]
        width = max(1, -(-(top + 1) // bins))
        rows = cursor.execute(f"""
            SELECT model_id, policy_step // $width AS bin, min(policy_step), max(policy_step), count(*), sum(num_rows),
                   sum(reward_sum) / nullif(sum(scored), 0),
                   count(*) FILTER (WHERE {PeerLookupRequest.informative_sql()})
            FROM groups GROUP BY model_id, bin ORDER BY model_id, bin""", {"width": width}).fetchall()
        return width, rows

    def dataset_counts(self) -> list[tuple[str, int, int, int, int]]:
        """(dataset, prompts, groups, rollouts, problems) of every dataset with groups or problems."""
        return self.catalog.cursor().execute("""
            WITH g AS (SELECT dataset, count(DISTINCT prompt_id) AS prompts, count(*) AS groups, sum(num_rows) AS rollouts
                       FROM groups GROUP BY dataset),
                 p AS (SELECT dataset, count(*) AS problems FROM problems GROUP BY dataset)
            SELECT dataset, coalesce(g.prompts, 0), coalesce(g.groups, 0), coalesce(g.rollouts, 0), coalesce(p.problems, 0)
            FROM g FULL OUTER JOIN p USING (dataset) ORDER BY dataset""").fetchall()

    # ------------------------------------------------------------------ stats

    def stats(self) -> StatsResponse:
        cursor = self.catalog.cursor()
        rows = cursor.execute(f"""
            SELECT model_id, count(*), sum(num_rows), count(DISTINCT prompt_id),
                   sum(reward_sum) / nullif(sum(scored), 0),
                   count(*) FILTER (WHERE {PeerLookupRequest.informative_sql()}),
                   max(policy_step), max(created_us)
            FROM groups GROUP BY model_id ORDER BY model_id""").fetchall()
        models = [
            ModelStats(model_id=m, groups=g, rollouts=int(r), prompts=p, success_rate=s, informative_groups=i,
                       max_policy_step=step, newest_created_at=us_to_datetime(c))
            for m, g, r, p, s, i, step, c in rows
        ]
        files = cursor.execute(
            "SELECT count(*) FROM files WHERE kind = 'rollouts' AND retired_us IS NULL").fetchall()[0][0]
        duplicates, conflicts = cursor.execute(
            "SELECT count(*) FILTER (WHERE NOT conflict), count(*) FILTER (WHERE conflict) FROM duplicates").fetchall()[0]
        quarantined = sum(1 for p in (self.catalog.root / "quarantine").iterdir() if not p.name.endswith(".reason.txt"))
        return StatsResponse(
            models=models, files=files, quarantined_files=quarantined,
            total_groups=sum(m.groups for m in models), total_rollouts=sum(m.rollouts for m in models),
            last_ingest_at=us_to_datetime(self.catalog.last_ingest_us), duplicate_groups=duplicates,
            conflicting_groups=conflicts,
        )


def _concat(pieces: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(pieces) if pieces else ROLLOUT_ARROW_SCHEMA.empty_table()
