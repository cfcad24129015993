"""The aggregates behind the trajectory browser: pages of prompts, one prompt's summary, success rate per policy
step, datasets, and the text of a group's tokens.

Queries run on the index's DuckDB (a cursor per thread, as the index's own stats and pages do) over its `groups`
table: one row per group, so no query here decodes a rollout. Problem texts live in the Parquet files under
prompts/, not in the index; `ProblemTexts` keeps the first stored copy of each (dataset, prompt) in memory (about
the size of the texts) and reads only files indexed since its last look.

"Failed by A, solved by B" is what GRAFT is for, and the prompts it lists are decided by the peer lookup itself
(`StoreIndex.select_peer_groups` with learner A and peer B): SQL narrows to prompts where A has groups and none of
A's rollouts is correct, and the lookup's own rule says which of them it would graft.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import MAX_LOOKUP_PROMPTS, PROBLEM_ARROW_SCHEMA, PeerLookupRequest
from schemas.browse import (
    DatasetsResponse,
    DatasetSummary,
    GroupTokens,
    ModelCurve,
    Outcome,
    PromptDetail,
    PromptModelSummary,
    PromptPage,
    PromptSummary,
    RolloutTokens,
    StepCurves,
    StepPoint,
    StoredProblem,
)
from services.store_api.index import StoreIndex
from services.store_api.queries import decode_cursor, encode_cursor, us_to_datetime
from services.store_api.tokens import TokenizerShelf, token_pieces

NO_CURSOR = 2**62  # above every seq: the first page
INFORMATIVE = PeerLookupRequest.informative_sql()  # the lookup's informative_only, per group row


class ProblemTexts:
    """Problem text and gold answer of every indexed (dataset, prompt): the copy the index points at."""

    def __init__(self, index: StoreIndex):
        self.index = index
        self._lock = threading.Lock()
        self._by_file: dict[int, pa.Table] = {}
        self._table: pa.Table = PROBLEM_ARROW_SCHEMA.empty_table()

    def table(self) -> pa.Table:
        """Columns prompt_id, dataset, problem, answer; files indexed since the last call are read now."""
        cursor = self.index._cursor()
        live = dict(cursor.execute("SELECT file_id, path FROM files WHERE kind = 'prompts'").fetchall())
        with self._lock:
            changed = False
            for gone in set(self._by_file) - set(live):  # quarantined meanwhile
                del self._by_file[gone]
                changed = True
            for file_id in sorted(set(live) - set(self._by_file)):
                owned = set(cursor.execute("SELECT dataset, prompt_id FROM problems WHERE file_id = ?", [file_id]).fetchall())
                try:
                    table = pq.read_table(self.index.root / live[file_id], schema=PROBLEM_ARROW_SCHEMA)
                except FileNotFoundError:  # quarantined between the query and the read: gone next time too
                    continue
                first_copy = [(d, p) in owned for d, p in zip(table.column("dataset").to_pylist(),
                                                               table.column("prompt_id").to_pylist())]
                self._by_file[file_id] = table.filter(pa.array(first_copy, pa.bool_()))
                changed = True
            if changed:
                tables = list(self._by_file.values())
                self._table = pa.concat_tables(tables) if tables else PROBLEM_ARROW_SCHEMA.empty_table()
            return self._table

    def of(self, prompt_id: str) -> list[StoredProblem]:
        table = self.table()
        rows = table.filter(pc.equal(table.column("prompt_id"), prompt_id)).select(["dataset", "problem", "answer"])
        return sorted((StoredProblem(**r) for r in rows.to_pylist()), key=lambda p: p.dataset)


class PageRow(NamedTuple):
    prompt_id: str
    last_seq: int
    dataset: str
    groups: int
    rollouts: int
    successes: int
    problem: str | None
    answer: str | None


class Browse:
    """The browser's aggregate queries over one store's index."""

    def __init__(self, index: StoreIndex, tokenizers: TokenizerShelf):
        self.index = index
        self.texts = ProblemTexts(index)
        self.tokenizers = tokenizers

    # ------------------------------------------------------------------ prompts

    def prompt_page(
        self, *, q: str | None = None, dataset: str | None = None, model: str | None = None,
        outcome: Outcome | None = None, failed_by: str | None = None, solved_by: str | None = None,
        cursor: str | None = None, limit: int = 50,
    ) -> PromptPage:
        """Prompts matching every filter given, the one with the newest ingested group first.

        `q`: a prefix of the prompt id or a piece of the problem text (case-insensitive). `outcome` counts the
        rollouts of `model` (every model without it); `model` alone: prompts it has groups for. `failed_by` A
        (with `solved_by` B, or any other model): prompts where A has groups, none of A's rollouts is correct,
        and the peer lookup for learner A (and peer B) finds a group. Work per page is bounded as in
        `/v1/rollouts`: a page may be short while next_cursor is set.
        """
        # keyset paging: a prompt's newest group only gets newer, so a page never repeats one shown before
        params: dict[str, object] = {"before": decode_cursor(cursor)[0] if cursor else NO_CURSOR, "limit": 0}
        having = ["max(seq) < $before"]
        if dataset is not None:
            having.append("bool_or(dataset = $dataset)")
            params["dataset"] = dataset
        if model is not None:
            params["model"] = model
        if model is not None or outcome is not None:
            only = " FILTER (WHERE model_id = $model)" if model is not None else ""
            groups, right = f"count(*){only}", f"coalesce(sum(successes){only}, 0)"
            rows = f"coalesce(sum(num_rows){only}, 0)"
            having.append({None: f"{groups} > 0", "all_fail": f"{groups} > 0 AND {right} = 0",
                           "mixed": f"{right} > 0 AND {right} < {rows}", "all_correct": f"{groups} > 0 AND {right} = {rows}",
                           "solved": f"{right} > 0"}[outcome])
        if failed_by is not None:
            # necessary for the lookup to graft (A failed everywhere, another model has a group); it decides the rest
            params["failed_by"] = failed_by
            peer = " AND model_id = $solved_by" if solved_by is not None else ""
            having.append("count(*) FILTER (WHERE model_id = $failed_by) > 0 "
                          "AND coalesce(sum(successes) FILTER (WHERE model_id = $failed_by), 0) = 0 "
                          f"AND count(*) FILTER (WHERE model_id <> $failed_by{peer}) > 0")
            if solved_by is not None:
                params["solved_by"] = solved_by
        text = "true"
        if q:
            text = "(starts_with(p.prompt_id, $q) OR contains(lower(t.problem), $q))"
            params["q"] = q.strip().lower()
        sql = f"""
            WITH per_prompt AS (
                SELECT prompt_id, max(seq) AS last_seq, arg_max(dataset, seq) AS dataset, count(*) AS groups,
                       sum(num_rows) AS rollouts, sum(successes) AS successes
                FROM groups GROUP BY prompt_id HAVING {' AND '.join(having)}
            ), texts AS (
                SELECT prompt_id, min_by(problem, dataset) AS problem, min_by(answer, dataset) AS answer
                FROM problem_texts GROUP BY prompt_id
            )
            SELECT p.prompt_id, p.last_seq, p.dataset, p.groups, p.rollouts, p.successes, t.problem, t.answer
            FROM per_prompt p LEFT JOIN texts t USING (prompt_id)
            WHERE {text} ORDER BY p.last_seq DESC LIMIT $limit"""
        db = self.index._cursor()
        db.register("problem_texts", self.texts.table())
        try:
            # with the lookup deciding, read candidates in batches as big as one lookup takes
            batch = limit + 1 if failed_by is None else min(MAX_LOOKUP_PROMPTS, self.index.settings.max_scan_groups)
            page: list[PageRow] = []
            scanned = 0
            while True:
                params["limit"] = batch
                rows = [PageRow(*r) for r in db.execute(sql, params).fetchall()]
                grafted = self._grafted([r.prompt_id for r in rows], failed_by, solved_by) if failed_by else None
                for row in rows:
                    if grafted is not None and row.prompt_id not in grafted:
                        params["before"] = row.last_seq
                        continue
                    if len(page) == limit:  # one more to show: the next page starts after the last shown
                        return self._page(page, encode_cursor(page[-1].last_seq, 0))
                    page.append(row)
                    params["before"] = row.last_seq
                if len(rows) < batch:
                    return self._page(page, None)
                scanned += len(rows)
                if scanned >= self.index.settings.max_scan_groups:
                    return self._page(page, encode_cursor(params["before"], 0))
        finally:
            db.unregister("problem_texts")

    def _grafted(self, prompt_ids: list[str], learner: str, peer: str | None) -> set[str]:
        """The prompts among `prompt_ids` for which the peer lookup (learner, peer) returns a group."""
        if not prompt_ids:
            return set()
        request = PeerLookupRequest(prompt_ids=prompt_ids, learner_model=learner,
                                    peer_models=[peer] if peer is not None else None)
        _, misses = self.index.select_peer_groups(request)
        return set(prompt_ids) - set(misses)

    def _page(self, rows: list[PageRow], next_cursor: str | None) -> PromptPage:
        models = self._model_summaries([r.prompt_id for r in rows])
        prompts = [PromptSummary(prompt_id=r.prompt_id, dataset=r.dataset, problem=r.problem, answer=r.answer,
                                 groups=r.groups, rollouts=int(r.rollouts), successes=int(r.successes),
                                 models=models.get(r.prompt_id, [])) for r in rows]
        return PromptPage(prompts=prompts, next_cursor=next_cursor)

    def _model_summaries(self, prompt_ids: list[str]) -> dict[str, list[PromptModelSummary]]:
        if not prompt_ids:
            return {}
        rows = self.index._cursor().execute(f"""
            SELECT prompt_id, model_id, count(*), sum(num_rows), sum(successes), count(*) FILTER (WHERE {INFORMATIVE}),
                   min(policy_step), max(policy_step), max(created_us)
            FROM groups WHERE prompt_id IN (SELECT unnest($ids::VARCHAR[]))
            GROUP BY prompt_id, model_id ORDER BY prompt_id, model_id""", {"ids": prompt_ids}).fetchall()
        summaries: dict[str, list[PromptModelSummary]] = {}
        for prompt, model, groups, rollouts, successes, informative, low, high, created in rows:
            summaries.setdefault(prompt, []).append(PromptModelSummary(
                model_id=model, groups=groups, rollouts=int(rollouts), successes=int(successes),
                informative_groups=informative, min_policy_step=low, max_policy_step=high,
                newest_created_at=us_to_datetime(created)))
        return summaries

    def prompt_detail(self, prompt_id: str) -> PromptDetail | None:
        """The prompt's stored problems and per-model counts; None when the store knows nothing of it."""
        models = self._model_summaries([prompt_id]).get(prompt_id, [])
        problems = self.texts.of(prompt_id)
        if not models and not problems:
            return None
        return PromptDetail(prompt_id=prompt_id, problems=problems, models=models)

    # ------------------------------------------------------------------ overview

    def step_curves(self, bins: int) -> StepCurves:
        """Success rate (mean reward over scored rollouts, as /v1/stats) and counts per policy-step bin per model."""
        db = self.index._cursor()
        top = db.execute("SELECT coalesce(max(policy_step), 0) FROM groups").fetchall()[0][0]
        width = max(1, -(-(top + 1) // bins))
        rows = db.execute(f"""
            SELECT model_id, policy_step // $width AS bin, min(policy_step), max(policy_step), count(*), sum(num_rows),
                   sum(reward_sum) / nullif(sum(scored), 0), count(*) FILTER (WHERE {INFORMATIVE})
            FROM groups GROUP BY model_id, bin ORDER BY model_id, bin""", {"width": width}).fetchall()
        curves: dict[str, list[StepPoint]] = {}
        for model, _, low, high, groups, rollouts, rate, informative in rows:
            curves.setdefault(model, []).append(StepPoint(step_min=low, step_max=high, groups=groups,
                                                          rollouts=int(rollouts), success_rate=rate,
                                                          informative_groups=informative))
        return StepCurves(bin_width=width, models=[ModelCurve(model_id=m, points=p) for m, p in curves.items()])

    def datasets(self) -> DatasetsResponse:
        db = self.index._cursor()
        rows = db.execute("""
            WITH g AS (SELECT dataset, count(DISTINCT prompt_id) AS prompts, count(*) AS groups, sum(num_rows) AS rollouts
                       FROM groups GROUP BY dataset),
                 p AS (SELECT dataset, count(*) AS problems FROM problems GROUP BY dataset)
            SELECT dataset, coalesce(g.prompts, 0), coalesce(g.groups, 0), coalesce(g.rollouts, 0), coalesce(p.problems, 0)
            FROM g FULL OUTER JOIN p USING (dataset) ORDER BY dataset""").fetchall()
        return DatasetsResponse(datasets=[DatasetSummary(dataset=d, prompts=pr, groups=g, rollouts=int(r), problems=n)
                                          for d, pr, g, r, n in rows])

    # ------------------------------------------------------------------ tokens

    def group_tokens(self, group_id: str, rollout_id: str | None = None) -> GroupTokens | None:
        """Each rollout's token pieces (or why there are none); None when the group (or rollout) is not stored."""
        table, _ = self.index.read_selected(lambda: (self.index.select_group(group_id), None))
        if table.num_rows == 0:
            return None
        rows = table.select(["rollout_id", "tokenizer_id", "completion_token_ids"]).to_pylist()
        if rollout_id is not None:
            rows = [r for r in rows if r["rollout_id"] == rollout_id]
            if not rows:
                return None
        tokenizer_id = rows[0]["tokenizer_id"]
        tokenizer, note = self.tokenizers.find(tokenizer_id)
        rollouts = []
        for row in rows:
            pieces = special = None
            if tokenizer is not None:
                pieces, special = token_pieces(tokenizer, row["completion_token_ids"])
            rollouts.append(RolloutTokens(rollout_id=row["rollout_id"], pieces=pieces, special=special))
        return GroupTokens(group_id=group_id, tokenizer_id=tokenizer_id, decoded=tokenizer is not None, note=note,
                           rollouts=rollouts)
