"""The import behind `graft-import`: text-only traces (`graft.rollouts.traces`) into stored groups without mu.

Each group of trace rows (one prompt, one step) becomes one stored group: its prompt matched to a problem when a
problem set is given (the store's prompt id is the problem's), each completion tokenised with the named tokenizer
(EOS appended when the traces ended), scored with math-verify against the gold or given the file's reward (said in
the rows' `generator_id` and the summary), group advantages computed, and `logprobs_mode` 'none' (docs/algorithm.md section
11: the trainers graft it with b = 1 and w = 1). Group ids hash the model, the prompt and the group's content, so a
re-import finds what it stored and skips it. A row that cannot be imported is reported in one line (file, row,
reason) and its whole group is left out: a stored group is always all the completions the trace holds for it.
Groups are written through graft-generate's sink (shards written atomically, a push, or a lake transaction)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from graft.rollouts.datasets import gold_answer, load_problems
from graft.rollouts.groups import assemble_group, make_group_id
from graft.rollouts.models import load_tokenizer_of, tokenizer_fingerprint
from graft.rollouts.sampling import Sample, SamplingParams
from graft.rollouts.scoring import Score, Scorer, extract_last_boxed
from graft.rollouts.traces import BadRow, TraceRow, read_traces, trace_files
from graft.schemas import NO_LOGPROBS, Problem, RolloutGroup
from graft.services.generator.config import ImportConfig
from graft.services.generator.generate import GroupSink

SCORED_WITH_GOLD = "graft-import:math-verify"  # generator_id of rows scored against the gold
GIVEN_REWARD = "graft-import:given-reward"  # generator_id of rows whose reward the trace file gave


@dataclass
class ImportStats:
    """What an import did (the summary line)."""

    files: int = 0
    rows: int = 0  # completions read from the files
    groups: int = 0  # groups stored by this run
    rollouts: int = 0
    skipped_already_stored: int = 0  # groups a previous import stored
    duplicate_groups: int = 0  # groups the files hold twice (same prompt, step and completions): stored once
    bad_rows: int = 0  # rows that could not be imported (each reported in one line)
    groups_left_out: int = 0  # groups left out for a bad row
    rewards_from_gold: int = 0  # rollouts scored with math-verify against the gold
    rewards_given: int = 0  # rollouts whose reward the file gave
    gold_unparsed: int = 0  # rollouts whose gold math-verify could not parse: no reward (null)
    no_boxed_answer: int = 0  # gold-scored rollouts without a \boxed{} answer
    correct: int = 0
    shards: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        scored = self.rewards_from_gold + self.rewards_given - self.gold_unparsed
        return {
            "files": self.files, "rows": self.rows, "groups": self.groups, "rollouts": self.rollouts,
            "skipped_already_stored": self.skipped_already_stored, "duplicate_groups": self.duplicate_groups,
            "bad_rows": self.bad_rows, "groups_left_out": self.groups_left_out,
            "rewards_from_gold": self.rewards_from_gold, "rewards_given": self.rewards_given,
            "gold_unparsed": self.gold_unparsed, "no_boxed_answer": self.no_boxed_answer,
            "success_rate": self.correct / scored if scored else None, "logprobs_mode": NO_LOGPROBS,
            "shards": len(self.shards), "wall_s": round(self.wall_s, 3),
        }


class ProblemMatcher:
    """A trace prompt's problem: the one whose text it equals, else the longest one whose text it holds (a prompt
    rendered with a template or worked examples holds the problem)."""

    def __init__(self, problems: list[Problem]):
        self.exact = {p.problem.strip(): p for p in problems}
        self.longest_first = sorted(problems, key=lambda p: -len(p.problem.strip()))
        self.found: dict[str, Problem | None] = {}

    def match(self, prompt: str) -> Problem | None:
        text = prompt.strip()
        if text not in self.found:
            self.found[text] = self.exact.get(text) or next(
                (p for p in self.longest_first if p.problem.strip() in text), None)
        return self.found[text]


@dataclass
class _Pending:
    """A group read, checked and tokenised, waiting for its scores."""

    problem: Problem
    rows: list[TraceRow]
    golds: list[str | None]
    token_ids: list[list[int]]
    from_gold: bool
    group_id: str


def run_import(config: ImportConfig, on_bad_row: Callable[[str], None] = print) -> ImportStats:
    """Import the traces `config` names into its store; each bad row is passed to `on_bad_row` as one line.

    Raises TraceFileError (a file that cannot be read or lacks a named column) before anything is stored."""
    started = time.perf_counter()
    stats = ImportStats()
    files = trace_files(config.files, config.format)
    columns, named = config.trace_columns()
    rows, bad = read_traces(files, config.format, columns, named)
    stats.files, stats.rows = len(files), len(rows)
    matcher = None
    if config.problems:
        matcher = ProblemMatcher(load_problems(config.problems, problem_field=config.problem_field,
                                               answer_field=config.answer_field))
    tokenizer = load_tokenizer_of(config.tokenizer)
    if config.finish_reason == "stop" and tokenizer.eos_token_id is None:
        raise ValueError(f"{config.tokenizer}: the tokenizer has no EOS token to end the completions with: set "
                         "finish_reason=length, or name the model's own tokenizer")
    tokenizer_id = tokenizer_fingerprint(tokenizer)

    by_key: dict[tuple, list[TraceRow]] = {}
    for row in rows:
        by_key.setdefault(row.group_key, []).append(row)
    for row in bad:  # a row that could not be read takes its group with it: a group is stored with all its completions
        stats.bad_rows += 1
        left_out = by_key.pop(row.group_key, None) if row.group_key is not None else None
        if left_out is not None:
            stats.groups_left_out += 1
            on_bad_row(f"{row}; its group's other {len(left_out)} completions are not imported")
        else:
            on_bad_row(str(row))
    sink = GroupSink(config.store, config.store_token)
    try:
        stored = set(sink.stored_groups(config.model_id, config.model_revision, config.policy_step))
        pending: list[_Pending] = []
        pending_ids: set[str] = set()
        for group_rows in by_key.values():
            checked = _check_group(group_rows, config, matcher, tokenizer, tokenizer_id)
            if isinstance(checked, BadRow):
                stats.bad_rows += 1
                stats.groups_left_out += 1
                on_bad_row(f"{checked}; its group of {len(group_rows)} completions is not imported")
            elif checked.group_id in stored:
                stats.skipped_already_stored += 1
            elif checked.group_id in pending_ids:
                stats.duplicate_groups += 1
            else:
                pending.append(checked)
                pending_ids.add(checked.group_id)
        # math-verify's workers start only when a group is scored against golds (they take seconds to import sympy)
        needs_scorer = any(p.from_gold for p in pending)
        with (Scorer(num_workers=config.score_workers, timeout_s=config.score_timeout_s) if needs_scorer
              else contextlib.nullcontext()) as scorer:
            for start in range(0, len(pending), config.groups_per_shard):
                groups, problems = _assemble(pending[start : start + config.groups_per_shard], config, scorer,
                                             tokenizer, tokenizer_id, stats)
                stats.shards.append(sink.write(groups, problems))
                stats.groups += len(groups)
                stats.rollouts += sum(len(g.rollouts) for g in groups)
    finally:
        sink.close()
        stats.wall_s = time.perf_counter() - started
    return stats


def _check_group(rows: list[TraceRow], config: ImportConfig, matcher: ProblemMatcher | None, tokenizer,
                 tokenizer_id: str) -> _Pending | BadRow:
    """The group ready to score, or its first bad row: a prompt that matches no problem, a row without the reward the
    config asks for, a given reward outside [0, 1]."""
    first = rows[0]
    matched = matcher.match(first.prompt) if matcher is not None else None
    if matcher is not None and matched is None:
        return BadRow(first.file, first.row, f"the prompt {first.prompt.strip()[:60]!r} matches no problem of "
                                             f"{config.problems} (none equal to it or inside it)")
    golds = [gold_answer(r.gold) if r.gold is not None else (matched.answer if matched else None) for r in rows]
    has_gold = [g is not None and bool(g.strip()) for g in golds]
    if config.reward == "gold" and not all(has_gold):
        lacking = rows[has_gold.index(False)]
        return BadRow(lacking.file, lacking.row, "no gold answer (gold_column, or problems to match the prompt to)")
    from_gold = all(has_gold) and config.reward != "given"
    if not from_gold:
        lacking = next((r for r in rows if r.reward is None), None)
        if lacking is not None:
            also = " and no gold answer (gold_column, or problems)" if config.reward == "auto" else ""
            return BadRow(lacking.file, lacking.row, f"no reward (reward_column){also}: a group is scored against "
                                                     "golds, or takes given rewards, for all its rows")
        outside = next((r for r in rows if not 0.0 <= r.reward <= 1.0), None)
        if outside is not None:
            return BadRow(outside.file, outside.row, f"reward {outside.reward!r} is outside [0, 1]: give rewards in "
                                                     "[0, 1], or score against the gold (reward=gold)")
    problem = matched or Problem.from_text(first.prompt, golds[0] or "", config.dataset)
    eos = [tokenizer.eos_token_id] if config.finish_reason == "stop" else []
    token_ids = [tokenizer(r.completion, add_special_tokens=False)["input_ids"] + eos for r in rows]
    content = json.dumps([tokenizer_id, config.temperature, config.top_p, config.top_k, config.finish_reason,
                          config.std_normalize, from_gold, first.step,
                          [(r.completion, g if from_gold else r.reward) for r, g in zip(rows, golds)]])
    key = hashlib.sha256(content.encode()).hexdigest()[:12]
    group_id = make_group_id(config.model_id, config.model_revision, config.policy_step, problem.prompt_id, 0, key)
    return _Pending(problem, rows, golds, token_ids, from_gold, group_id)


def _assemble(batch: list[_Pending], config: ImportConfig, scorer: Scorer | None, tokenizer, tokenizer_id: str,
              stats: ImportStats) -> tuple[list[RolloutGroup], list[Problem]]:
    """Score a batch of groups (math-verify for those with golds, in one call) and assemble them."""
    to_score = [(r.completion, g) for p in batch if p.from_gold for r, g in zip(p.rows, p.golds)]
    scores = iter(scorer.score([t for t, _ in to_score], [g for _, g in to_score]) if to_score else [])
    groups, problems = [], {}
    for pending in batch:
        if pending.from_gold:
            group_scores = [next(scores) for _ in pending.rows]
            stats.rewards_from_gold += len(group_scores)
            stats.gold_unparsed += sum(s.reward is None for s in group_scores)
            stats.no_boxed_answer += sum(s.extracted_answer is None for s in group_scores)
        else:
            group_scores = [Score(reward=r.reward, correct=r.reward > 0, extracted_answer=extract_last_boxed(r.completion))
                            for r in pending.rows]
            stats.rewards_given += len(group_scores)
        stats.correct += sum(s.correct for s in group_scores)
        samples = [Sample(token_ids=ids, token_logprobs=[], text=r.completion, finish_reason=config.finish_reason)
                   for r, ids in zip(pending.rows, pending.token_ids)]
        params = SamplingParams(n=len(samples), temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                max_tokens=config.max_tokens or max(1, *(len(ids) for ids in pending.token_ids)))
        groups.append(assemble_group(
            pending.problem, samples, group_scores, model_id=config.model_id, model_revision=config.model_revision,
            tokenizer_id=tokenizer_id, policy_step=config.policy_step,
            generator_id=SCORED_WITH_GOLD if pending.from_gold else GIVEN_REWARD, params=params,
            eos_token_ids={tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set(),
            group_id=pending.group_id, std_normalize=config.std_normalize, engine_logprobs_mode=NO_LOGPROBS))
        problems.setdefault(pending.problem.prompt_id, pending.problem)
    return groups, list(problems.values())
