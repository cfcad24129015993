"""The aggregates behind the trajectory browser: pages of prompts, one prompt's summary, success rate per policy
step, datasets, and the text of a group's tokens.

Everything is read through the index's public queries (queries.py): one row per group, so nothing here decodes a
rollout. A page of prompts walks the groups newest first, a span of seqs at a time (DuckDB reads only that span),
and takes each prompt's counts from the index's in-memory groups of it, so its cost is bounded by
max_scan_groups, not by the store's size; the overview (step curves, datasets) aggregates every group. Problem
texts live in the Parquet files under prompts/, not in the index; `ProblemTexts` keeps the first stored copy of
each (dataset, prompt) in memory (about the size of the texts) and `PromptDatasets` the datasets each prompt
has groups in; both read only what was indexed since their last look.

"Failed by A, solved by B" is what GRAFT is for, and the prompts it lists are decided by the peer lookup itself
(`IndexQueries.select_peer_groups` with learner A and peer B): SQL narrows to prompts where A has groups and none of
A's rollouts is correct, and the lookup's own rule says which of them it would graft.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from graft.schemas import MAX_LOOKUP_PROMPTS, NO_LOGPROBS, PROBLEM_ARROW_SCHEMA, PeerLookupRequest
from graft.schemas.browse import (
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
from graft.services.store_api.browser.tokens import TokenizerShelf, token_pieces
from graft.services.store_api.local import GroupRef, StoreIndex, decode_cursor, encode_cursor, us_to_datetime

NO_CURSOR = 2**62  # above every seq: the first page


class ProblemTexts:
    """Problem text and gold answer of every indexed (dataset, prompt): the copy the index points at."""

    def __init__(self, index: StoreIndex):
        self.index = index
        self._lock = threading.Lock()
        self._by_file: dict[int, pa.Table] = {}
        self._table: pa.Table = PROBLEM_ARROW_SCHEMA.empty_table()
        # prompt id -> (dataset, problem, answer) of its first dataset by name, kept as files come
        self._by_prompt: dict[str, tuple[str, str, str]] = {}

    def table(self) -> pa.Table:
        """Columns prompt_id, dataset, problem, answer; files indexed since the last call are read now."""
        live = self.index.queries.problem_files()
        with self._lock:
            new: list[pa.Table] = []
            gone = set(self._by_file) - set(live)  # quarantined meanwhile
            for file_id in gone:
                del self._by_file[file_id]
            for file_id in sorted(set(live) - set(self._by_file)):
                owned = self.index.queries.problems_of_file(file_id)
                try:
                    table = pq.read_table(self.index.catalog.root / live[file_id], schema=PROBLEM_ARROW_SCHEMA)
                except FileNotFoundError:  # quarantined between the query and the read: gone next time too
                    continue
                first_copy = [(d, p) in owned for d, p in zip(table.column("dataset").to_pylist(),
                                                               table.column("prompt_id").to_pylist())]
                self._by_file[file_id] = table.filter(pa.array(first_copy, pa.bool_()))
                new.append(self._by_file[file_id])
            if gone or new:
                tables = list(self._by_file.values())
                self._table = pa.concat_tables(tables) if tables else PROBLEM_ARROW_SCHEMA.empty_table()
                if gone:
                    self._by_prompt, new = {}, tables
                for table in new:
                    self._add_texts(table)
            return self._table

    def _add_texts(self, table: pa.Table) -> None:
        for prompt, dataset, problem, answer in zip(*(table.column(n).to_pylist() for n in (
                "prompt_id", "dataset", "problem", "answer"))):
            if prompt not in self._by_prompt or dataset < self._by_prompt[prompt][0]:
                self._by_prompt[prompt] = (dataset, problem, answer)

    def by_prompt(self) -> dict[str, tuple[str, str, str]]:
        """prompt id -> (dataset, problem, answer) of its first dataset by name (a prompt id is the hash of the
        text: every dataset's copy has the same problem), as the listing shows it."""
        self.table()
        return self._by_prompt

    def of(self, prompt_id: str) -> list[StoredProblem]:
        table = self.table()
        rows = table.filter(pc.equal(table.column("prompt_id"), prompt_id)).select(["dataset", "problem", "answer"])
        return sorted((StoredProblem(**r) for r in rows.to_pylist()), key=lambda p: p.dataset)


class PromptDatasets:
    """The datasets each prompt has groups in, read by seq: each call reads only the groups indexed since the last
    (groups get new seqs, never lose theirs). When the index holds fewer groups than were read (a quarantined
    shard's left), or a rebuild started the seqs again, it reads every group again."""

    def __init__(self, index: StoreIndex):
        self.index = index
        self._lock = threading.Lock()
        self._after = 0  # the newest seq read
        self._read = 0  # groups read
        self._by_prompt: dict[str, set[str]] = {}

    def of(self) -> dict[str, set[str]]:
        with self._lock:
            rows, count = self.index.queries.groups_after(self._after)
            if self._read + len(rows) != count or self.index.queries.newest_seq() <= self._after:
                self._after, self._read, self._by_prompt = 0, 0, {}
                rows, count = self.index.queries.groups_after(0)
            for _, prompt, dataset in rows:
                self._by_prompt.setdefault(prompt, set()).add(dataset)
            if rows:
                self._after = rows[-1][0]
            self._read += len(rows)
            return self._by_prompt


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
        self.datasets_of = PromptDatasets(index)
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
        `/v1/rollouts`: at most max_scan_groups groups are walked, so a page may be short while next_cursor is set.
        """
        # keyset paging on the walk's position: a prompt's newest group only gets newer, so a page never repeats
        # one shown before (a prompt whose newest group is above the cursor was shown, or moved up)
        before = min(decode_cursor(cursor)[0] if cursor else NO_CURSOR, self.index.queries.newest_seq())
        datasets = self.datasets_of.of() if dataset is not None else {}
        texts = self.texts.by_prompt()
        needle = q.strip().lower() if q else None
        budget = self.index.settings.max_scan_groups
        # unfiltered, a page's prompts are among its first few groups; filtered, the walk likely takes the budget
        filtered = any(v is not None for v in (q, dataset, model, outcome, failed_by))
        span = budget if filtered else min(budget, 4 * (limit + 1))
        page: list[tuple[PageRow, list[GroupRef]]] = []
        met: set[str] = set()  # prompts met in this walk: each is decided at its first (newest) group met
        walked = 0
        while before > 1 and walked < budget:
            span = min(span, budget - walked)
            heads = self.index.queries.prompts_before(before, span)
            walked += span
            candidates: list[tuple[PageRow, list[GroupRef]]] = []
            for seq, prompt, newest_dataset in heads:
                if prompt in met:
                    continue
                met.add(prompt)
                # the cheap filters first; the prompt's groups are copied from the index's mirror only for the rest
                if dataset is not None and dataset not in datasets.get(prompt, ()):
                    continue
                _, problem, answer = texts.get(prompt, (None, None, None))
                if needle and not (prompt.startswith(needle) or (problem is not None and needle in problem.lower())):
                    continue
                refs = self.index.queries.prompt_refs(prompt)
                if not _passes(refs, seq, model, outcome, failed_by, solved_by):
                    continue
                row = PageRow(prompt, seq, newest_dataset, len(refs), sum(r.num_rows for r in refs),
                              sum(r.successes for r in refs), problem, answer)
                candidates.append((row, refs))
            if failed_by is not None:  # the lookup decides, in batches as big as one lookup takes
                grafted: set[str] = set()
                prompts = [row.prompt_id for row, _ in candidates]
                for first in range(0, len(prompts), MAX_LOOKUP_PROMPTS):
                    grafted |= self._grafted(prompts[first:first + MAX_LOOKUP_PROMPTS], failed_by, solved_by)
                candidates = [(row, refs) for row, refs in candidates if row.prompt_id in grafted]
            for row, refs in candidates:
                if len(page) == limit:  # one more to show: the next page starts after the last shown
                    return self._page(page, encode_cursor(page[-1][0].last_seq, 0))
                page.append((row, refs))
            before -= span
            span *= 2
        return self._page(page, encode_cursor(before, 0) if before > 1 else None)

    def _grafted(self, prompt_ids: list[str], learner: str, peer: str | None) -> set[str]:
        """The prompts among `prompt_ids` for which the peer lookup (learner, peer) returns a group."""
        if not prompt_ids:
            return set()
        request = PeerLookupRequest(prompt_ids=prompt_ids, learner_model=learner,
                                    peer_models=[peer] if peer is not None else None)
        _, misses = self.index.queries.select_peer_groups(request)
        return set(prompt_ids) - set(misses)

    def _page(self, rows: list[tuple[PageRow, list[GroupRef]]], next_cursor: str | None) -> PromptPage:
        prompts = [PromptSummary(prompt_id=r.prompt_id, dataset=r.dataset, problem=r.problem, answer=r.answer,
                                 groups=r.groups, rollouts=int(r.rollouts), successes=int(r.successes),
                                 models=_model_summaries(refs)) for r, refs in rows]
        return PromptPage(prompts=prompts, next_cursor=next_cursor)

    def prompt_detail(self, prompt_id: str) -> PromptDetail | None:
        """The prompt's stored problems and per-model counts; None when the store knows nothing of it."""
        models = _model_summaries(self.index.queries.prompt_refs(prompt_id))
        problems = self.texts.of(prompt_id)
        if not models and not problems:
            return None
        return PromptDetail(prompt_id=prompt_id, problems=problems, models=models)

    # ------------------------------------------------------------------ overview

    def step_curves(self, bins: int) -> StepCurves:
        """Success rate (mean reward over scored rollouts, as /v1/stats) and counts per policy-step bin per model."""
        width, rows = self.index.queries.step_bins(bins)
        curves: dict[str, list[StepPoint]] = {}
        for model, _, low, high, groups, rollouts, rate, informative in rows:
            curves.setdefault(model, []).append(StepPoint(step_min=low, step_max=high, groups=groups,
                                                          rollouts=int(rollouts), success_rate=rate,
                                                          informative_groups=informative))
        return StepCurves(bin_width=width, models=[ModelCurve(model_id=m, points=p) for m, p in curves.items()])

    def datasets(self) -> DatasetsResponse:
        rows = self.index.queries.dataset_counts()
        return DatasetsResponse(datasets=[DatasetSummary(dataset=d, prompts=pr, groups=g, rollouts=int(r), problems=n)
                                          for d, pr, g, r, n in rows])

    # ------------------------------------------------------------------ tokens

    def group_tokens(self, group_id: str, rollout_id: str | None = None) -> GroupTokens | None:
        """Each rollout's token pieces (or why there are none); None when the group (or rollout) is not stored."""
        table, _ = self.index.queries.read_selected(lambda: (self.index.queries.select_group(group_id), None))
        if table.num_rows == 0:
            return None
        rows = table.select(["rollout_id", "tokenizer_id", "completion_token_ids", "logprobs_mode"]).to_pylist()
        if rollout_id is not None:
            rows = [r for r in rows if r["rollout_id"] == rollout_id]
            if not rows:
                return None
        tokenizer_id = rows[0]["tokenizer_id"]
        tokenizer, note = self.tokenizers.find(tokenizer_id)
        with_mu = rows[0]["logprobs_mode"] != NO_LOGPROBS  # a group is all with mu or all without
        if not with_mu:
            note += ("; no behaviour logprobs: the rows' source gave none (logprobs_mode 'none'), so no token has a "
                     "probability")
        rollouts = []
        for row in rows:
            pieces = special = None
            if tokenizer is not None:
                pieces, special = token_pieces(tokenizer, row["completion_token_ids"])
            rollouts.append(RolloutTokens(rollout_id=row["rollout_id"], pieces=pieces, special=special))
        return GroupTokens(group_id=group_id, tokenizer_id=tokenizer_id, decoded=tokenizer is not None, note=note,
                           behaviour_logprobs=with_mu, rollouts=rollouts)


def _passes(refs: list[GroupRef], newest: int, model: str | None, outcome: Outcome | None, failed_by: str | None,
            solved_by: str | None) -> bool:
    """Whether a prompt with these groups has its newest at seq `newest` and passes the model, outcome and
    failed_by filters (the lookup decides the rest of failed_by). One pass over the groups: a page walks up to
    max_scan_groups prompts."""
    counted = right = rollouts = learner = learner_right = peers = 0
    for ref in refs:
        if ref.seq > newest:
            return False  # a newer group: the prompt is listed at that one (above the cursor)
        if model is None or ref.model_id == model:
            counted += 1
            right += ref.successes
            rollouts += ref.num_rows
        if ref.model_id == failed_by:
            learner += 1
            learner_right += ref.successes
        elif solved_by is None or ref.model_id == solved_by:
            peers += 1
    if (model is not None or outcome is not None) and not (counted and {
            None: True, "all_fail": right == 0, "mixed": 0 < right < rollouts, "all_correct": right == rollouts,
            "solved": right > 0}[outcome]):
        return False  # every outcome needs a group of the model counted
    # failed_by: necessary for the lookup to graft: A failed everywhere, another model (B) has a group
    return failed_by is None or (learner > 0 and learner_right == 0 and peers > 0)


def _model_summaries(refs: list[GroupRef]) -> list[PromptModelSummary]:
    """Per-model counts of a prompt's groups, by model id."""
    by_model: dict[str, list[GroupRef]] = {}
    for ref in refs:
        by_model.setdefault(ref.model_id, []).append(ref)
    return [PromptModelSummary(
        model_id=model, groups=len(of_model), rollouts=sum(r.num_rows for r in of_model),
        successes=sum(r.successes for r in of_model),
        informative_groups=sum(0 < r.successes < r.group_size for r in of_model),  # PeerLookupRequest's rule
        min_policy_step=min(r.policy_step for r in of_model), max_policy_step=max(r.policy_step for r in of_model),
        newest_created_at=us_to_datetime(max(r.created_us for r in of_model)))
        for model, of_model in sorted(by_model.items())]
