"""The import behind `graft-import`: text-only traces (`graft.rollouts.traces`) into stored groups without mu.

Two passes over the files. The first reads only the prompts: every named column is checked, the prompts are matched
to the problems (`ProblemIndex`), and the import is refused (one line, nothing stored) when none matches, or when a
TRL or verl trace has no problems to match (their prompts are as the model saw them: stored under those ids, no
learner's lookup would find the groups); otherwise it says how many matched before anything is stored. The second
streams the groups (`read_groups`, a batch of rows at a time): eval rows (the run's eval set) left out, each group's
prompt matched to its problem (the store's prompt id is the problem's), the prompt the trace followed kept beside it
(`prompt_text`, `prompt_token_ids`), each completion tokenised with the named tokenizer, its finish reason taken from
the data (a finish column, or a completion reaching the run's max_tokens) with EOS appended to finished ones only,
the rewards by the run's own rule (its reward column with a stated success threshold, or math-verify against the gold
with the answer extraction the run used; where both exist their disagreement is counted, and said when above
`max_disagreement`), group advantages computed, `logprobs_mode` 'none' (docs/algorithm.md section 11: the trainers graft it
with b = 1 and w = 1), and the trace's step as the rows' policy step.

Group ids hash the model, the step, the prompt and the group's content, so a re-import finds what it stored and
skips it; a group the files hold again under a later step (TRL's completions table is rewritten from a deque every
logging step) is stored once, at its first step. A row that cannot be imported is reported in one line (file, row,
reason) and its whole group is left out: a stored group is always all the completions the trace holds for it. Groups
are written through graft-generate's sink (shards written atomically, a push, or a lake transaction), a batch of
`groups_per_shard` at a time, so memory stays flat in the files' size."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from graft.rollouts.datasets import ProblemIndex, gold_answer, load_problems
from graft.rollouts.groups import assemble_group, make_group_id
from graft.rollouts.models import load_tokenizer_of, tokenizer_fingerprint
from graft.rollouts.sampling import Sample, SamplingParams
from graft.rollouts.scoring import Score, Scorer, answer_extractor
from graft.rollouts.traces import (
    BadRow,
    LeftOut,
    TraceColumns,
    TraceGroup,
    columns_of_file,
    file_columns,
    prompt_problem,
    read_groups,
    records,
    trace_files,
)
from graft.schemas import NO_LOGPROBS, Problem
from graft.services.generator.config import ImportConfig
from graft.services.generator.generate import GroupSink

GENERATOR_ID = "graft-import"  # the rows' generator_id: graft-import:<the rule that scored them>


class ImportRefused(ValueError):
    """An import that would store groups no learner finds, or cannot tell how its completions ended: nothing stored."""


@dataclass
class ImportStats:
    """What an import did (the summary line)."""

    files: int = 0
    rows: int = 0  # completions read from the files (a row that cannot be read counts as one)
    groups: int = 0  # groups stored by this run
    rollouts: int = 0
    skipped_already_stored: int = 0  # groups a previous import stored
    repeated_groups: int = 0  # groups the files hold again (TRL's rewritten tables, the same group under a later step)
    eval_rows: int = 0  # completions of the run's eval prompts, left out
    bad_rows: int = 0  # rows that could not be imported (each reported in one line)
    groups_left_out: int = 0  # groups left out for a bad row, a missing row or an unmatched prompt
    prompt_rows: int = 0  # rows (first pass) whose prompt was matched against the problems
    prompt_rows_matched: int = 0
    scored_by: Counter = field(default_factory=Counter)  # rule -> rows it scored
    gold_unparsed: int = 0  # rows whose gold math-verify could not parse: no reward (null)
    no_answer: int = 0  # math-verify-scored rows in which the answer rule found no answer
    compared: int = 0  # rows with both the run's own success and math-verify's
    disagreements: int = 0  # of those, rows where the two differ
    finish: Counter = field(default_factory=Counter)  # finish reason -> rows
    finish_from: Counter = field(default_factory=Counter)  # column / max_tokens / stated -> rows
    correct: int = 0
    scored: int = 0  # rows with a reward (not null)
    tokens: int = 0
    shards: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self, max_disagreement: float) -> dict:
        share = self.disagreements / self.compared if self.compared else None
        return {
            "files": self.files, "rows": self.rows, "groups": self.groups, "rollouts": self.rollouts,
            "skipped_already_stored": self.skipped_already_stored, "repeated_groups": self.repeated_groups,
            "eval_rows": self.eval_rows, "bad_rows": self.bad_rows, "groups_left_out": self.groups_left_out,
            "prompt_rows": self.prompt_rows, "prompt_rows_matched": self.prompt_rows_matched,
            "scored_by": dict(self.scored_by), "gold_unparsed": self.gold_unparsed, "no_answer": self.no_answer,
            "disagreement": {"compared": self.compared, "differ": self.disagreements, "share": share,
                             "max_share": max_disagreement},
            "finish": dict(self.finish), "finish_from": dict(self.finish_from),
            "success_rate": self.correct / self.scored if self.scored else None, "logprobs_mode": NO_LOGPROBS,
            "tokens": self.tokens, "shards": len(self.shards), "wall_s": round(self.wall_s, 3),
            "rows_per_s": round(self.rows / self.wall_s, 1) if self.wall_s else None,
        }


@dataclass
class _Pending:
    """A group read and checked, waiting for its tokens and scores."""

    trace: TraceGroup
    problem: Problem
    golds: list[str | None]  # per completion: the gold math-verify compares with (None: none)
    given: list[bool] | None  # per completion: the run's own success, when its rule is known
    rule: str  # what scores it: "given:..." or "math-verify:..."
    policy_step: int
    prompt_text: str | None
    group_id: str


def run_import(config: ImportConfig, on_bad_row: Callable[[str], None] = print,
               on_note: Callable[[str], None] = print) -> ImportStats:
    """Import the traces `config` names into its store; each bad row or left-out group is passed to `on_bad_row` as
    one line, what the import notices (prompts matched, rewards disagreeing) to `on_note`.

    Raises TraceFileError (a file that cannot be read or lacks a named column) or ImportRefused before anything is
    stored."""
    started = time.perf_counter()
    stats = ImportStats()
    files = trace_files(config.files, config.format)
    columns, named = config.trace_columns()
    _check_stated(config, columns)
    index = ProblemIndex(_problems(config.problems, config)) if config.problems else None
    eval_index = ProblemIndex(_problems(config.eval_problems, config)) if config.eval_problems else None
    tokenizer = load_tokenizer_of(config.tokenizer)
    if tokenizer.eos_token_id is None and config.finish_reason != "length":
        raise ImportRefused(f"{config.tokenizer}: the tokenizer has no EOS token to end finished completions with: "
                            "name the model's own tokenizer (or set finish_reason=length if every completion was cut)")
    _survey(files, config, columns, named, index, eval_index, stats, on_note)
    stats.files = len(files)
    importer = _Importer(config, tokenizer, index, eval_index, stats, on_bad_row)
    try:
        importer.run(read_groups(files, config.format, columns, named, config.group_size))
    finally:
        importer.close()
        stats.wall_s = time.perf_counter() - started
    if stats.compared and stats.disagreements / stats.compared > config.max_disagreement:
        on_note(f"the run's own rewards and math-verify ({config.extract}) disagree on {stats.disagreements} of "
                f"{stats.compared} rows ({stats.disagreements / stats.compared:.1%}, above max_disagreement "
                f"{config.max_disagreement:.0%}): check the answer rule (extract) or the success threshold")
    return stats


def _problems(source: str, config: ImportConfig) -> list[Problem]:
    return load_problems(source, problem_field=config.problem_field, answer_field=config.answer_field)


def _check_stated(config: ImportConfig, columns: TraceColumns) -> None:
    """Refuse what cannot be imported right whatever the files hold: a TRL or verl trace with no problems to match
    (its prompts are as the model saw them), and no way to tell how the completions ended."""
    if config.format in ("trl", "verl") and not config.problems and not config.prompts_are_problems:
        seen = "the chat template applied and special tokens dropped" if config.format == "verl" else \
            "the run's dataset prompts, instructions included"
        raise ImportRefused(f"--format {config.format} without --problems: its prompts are as the model saw them "
                            f"({seen}), so the groups would be stored under prompt ids no learner's lookup asks for: "
                            "pass --problems (the learner's dataset), or --set prompts_are_problems=true if the "
                            "prompts are the problems' own texts")
    if config.finish_reason == "auto" and columns.finish is None and config.max_tokens is None:
        raise ImportRefused("how the completions ended is unknown: set max_tokens (the run's completion budget: a "
                            "completion reaching it was cut), finish_column (each row's finish reason), or "
                            "finish_reason=stop if every completion ended")


def _survey(files: list[Path], config: ImportConfig, columns: TraceColumns, named: frozenset[str],
            index: ProblemIndex | None, eval_index: ProblemIndex | None, stats: ImportStats,
            on_note: Callable[[str], None]) -> None:
    """The first pass: every file's columns checked, its prompts (that column only) matched to the problems; refuse
    when none matches, else say how many did."""
    for path in files:
        used = columns_of_file(path, config.format, columns, named, file_columns(path))
        if index is None:
            continue
        for record in records(path, [used.problem]):
            if isinstance(record, BadRow):
                continue
            problem = prompt_problem(record.get(used.problem))
            if problem is None or (eval_index is not None and eval_index.match(problem) is not None):
                continue
            stats.prompt_rows += 1
            stats.prompt_rows_matched += index.match(problem) is not None
    if index is None:
        if config.format == "columns":
            on_note(f"no --problems: the groups are stored under their prompts' own text ({columns.problem!r}); a "
                    "learner finds them when its dataset holds those exact texts")
        return
    if not stats.prompt_rows_matched:
        raise ImportRefused(f"none of the {stats.prompt_rows} rows' prompts in {len(files)} file(s) matches a problem "
                            f"of {config.problems} (none equal to one or holding one): nothing stored; pass the "
                            "dataset the traces answered (--problems), or problem_field naming its problem column")
    on_note(f"{stats.prompt_rows_matched} of {stats.prompt_rows} rows' prompts match a problem of {config.problems}"
            + (f"; the other {stats.prompt_rows - stats.prompt_rows_matched} are left out (one line each)"
               if stats.prompt_rows_matched < stats.prompt_rows else ""))


class _Importer:
    """The second pass: groups checked, batched, tokenised, scored, assembled and written."""

    def __init__(self, config: ImportConfig, tokenizer, index: ProblemIndex | None, eval_index: ProblemIndex | None,
                 stats: ImportStats, on_bad_row: Callable[[str], None]):
        self.config, self.tokenizer, self.index, self.eval_index = config, tokenizer, index, eval_index
        self.stats, self.on_bad_row = stats, on_bad_row
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)
        self.extract = answer_extractor(config.extract, config.extract_regex)
        self.sink = GroupSink(config.store, config.store_token)
        self.stored: dict[int, set[str]] = {}  # policy step -> group ids stored (read once per step)
        self.seen: set[bytes] = set()  # content of the groups met, step aside: a repeat is stored once
        self.pending: list[_Pending] = []
        self.scorer: Scorer | None = None  # math-verify's workers, started when a group first needs them
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="import-scoring")

    def run(self, items) -> None:
        for item in items:
            if isinstance(item, BadRow):
                self.stats.bad_rows += 1
                self.stats.rows += 1
                self.stats.groups_left_out += item.own_group
                self.on_bad_row(str(item) + ("; its group is not imported" if item.own_group else ""))
            elif isinstance(item, LeftOut):
                self.stats.groups_left_out += 1
                self.stats.rows += len(item.group.completions)
                self.on_bad_row(str(item))
            else:
                self.stats.rows += len(item.completions)
                self._take(item)
                if len(self.pending) >= self.config.groups_per_shard:
                    self._flush()
        self._flush()

    def close(self) -> None:
        self.pool.shutdown()
        self.sink.close()
        if self.scorer is not None:
            self.scorer.close()

    def _left_out(self, group: TraceGroup, reason: str) -> None:
        self.stats.bad_rows += 1
        self.on_bad_row(str(LeftOut(group, reason)))
        self.stats.groups_left_out += 1

    def _take(self, trace: TraceGroup) -> None:
        """Check a group and queue it, or say why it is left out (or skipped: stored already, a repeat, eval rows)."""
        config = self.config
        if self.eval_index is not None and self.eval_index.match(trace.problem) is not None:
            self.stats.eval_rows += len(trace.completions)
            return
        matched = self.index.match(trace.problem) if self.index is not None else None
        if self.index is not None and matched is None:
            self._left_out(trace, f"its prompt {trace.problem.strip()[:60]!r} matches no problem of {config.problems} "
                                  "(none equal to it or inside it)")
            return
        if config.finish_reason == "auto" and config.max_tokens is None and None in trace.finishes:
            self._left_out(trace, f"a row has no finish reason ({config.finish_column!r} is null) and max_tokens is "
                                  "not set to tell a cut completion")
            return
        golds = [gold_answer(g) if g is not None else (matched.answer if matched else None) for g in trace.golds]
        has_gold = all(g is not None and g.strip() for g in golds)
        given = self._given(trace)
        if isinstance(given, str):
            self._left_out(trace, given)
            return
        if config.reward == "gold" or (config.reward == "auto" and given is None):
            if not has_gold:
                self._left_out(trace, "no gold answer (gold_column, or problems to match the prompt to)" + (
                    "" if config.reward == "gold" else " and no usable reward of the run's own (reward_column, a "
                                                       "boolean or a number with success_threshold)"))
                return
            rule = f"math-verify:{config.extract}"
        else:
            if given is None:
                self._left_out(trace, "no reward of the run's own for every row (reward_column): reward=given takes "
                                      "the run's reward only")
                return
            column = trace.reward_column
            rule = f"given:{column}" if all(isinstance(r, bool) for r in trace.rewards) else \
                f"given:{column}>={config.success_threshold:g}"
        problem = matched or Problem.from_text(trace.problem, golds[0] or "", config.dataset)
        step = config.policy_step if config.policy_step is not None else (trace.step or 0)
        prompt_text = self._prompt_text(trace)
        content = json.dumps([self.tokenizer_id, config.temperature, config.top_p, config.top_k, config.max_tokens,
                              config.finish_reason, config.std_normalize, rule, problem.prompt_id, prompt_text,
                              trace.prompt_token_ids, trace.completions, golds if rule.startswith("math") else given,
                              trace.finishes], ensure_ascii=False).encode()
        digest = hashlib.sha256(content)
        if digest.digest() in self.seen:
            self.stats.repeated_groups += 1
            return
        self.seen.add(digest.digest())
        group_id = make_group_id(config.model_id, config.model_revision, step, problem.prompt_id, 0,
                                 digest.hexdigest()[:12])
        if step not in self.stored:
            self.stored[step] = set(self.sink.stored_groups(config.model_id, config.model_revision, step))
        if group_id in self.stored[step]:
            self.stats.skipped_already_stored += 1
            return
        self.pending.append(_Pending(trace, problem, golds if has_gold else [None] * len(golds), given, rule, step,
                                     prompt_text, group_id))

    def _given(self, trace: TraceGroup) -> list[bool] | None | str:
        """The run's own success of each row (its reward column: a boolean, or a number at >= success_threshold);
        None when some row has none or its rule is unknown; a reason (str) when a value cannot be read so."""
        rewards = trace.rewards
        if any(r is None for r in rewards):
            return None
        if all(isinstance(r, bool) for r in rewards):
            return list(rewards)
        if self.config.success_threshold is None:
            if self.config.reward == "given":
                return (f"reward {next(r for r in rewards if not isinstance(r, bool))!r} is a number: state the run's "
                        "success rule with --set success_threshold=X (success at reward >= X)")
            return None
        return [float(r) >= self.config.success_threshold for r in rewards]

    def _prompt_text(self, trace: TraceGroup) -> str | None:
        """The prompt the trace followed: its text, or its turns rendered by the tokenizer's chat template (the run's
        own, as TRL rendered them); None when the file does not show it."""
        if trace.prompt is None or isinstance(trace.prompt, str):
            return trace.prompt
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        return self.tokenizer.apply_chat_template(trace.prompt, tokenize=False, add_generation_prompt=True)

    def _flush(self) -> None:
        """Tokenise, score and write the queued groups (one shard, push or lake commit)."""
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        config, stats = self.config, self.stats
        texts = [c for p in batch for c in p.trace.completions]
        # math-verify works in its worker processes while this one tokenises (the tokenizer's Rust code releases the
        # GIL): the batch costs the longer of the two, not their sum
        scoring = self.pool.submit(self._math_verify, batch)
        ids = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"])
        verified = iter(scoring.result())
        eos = self.tokenizer.eos_token_id
        groups, problems = [], {}
        for pending in batch:
            token_ids = [next(ids) for _ in pending.trace.completions]
            checks = [next(verified) if g is not None else None for g in pending.golds]
            if pending.rule.startswith("math-verify"):
                scores = checks
                stats.gold_unparsed += sum(s.reward is None for s in scores)
                stats.no_answer += sum(s.extracted_answer is None for s in scores)
            else:
                scores = [Score(reward=float(ok), correct=ok, extracted_answer=(
                    check.extracted_answer if check is not None else self.extract(text)))
                          for ok, text, check in zip(pending.given, pending.trace.completions, checks, strict=True)]
            if pending.given is not None:
                for ok, check in zip(pending.given, checks, strict=True):
                    if check is not None and check.reward is not None:
                        stats.compared += 1
                        stats.disagreements += ok != check.correct
            stats.scored_by[pending.rule] += len(scores)
            stats.scored += sum(s.reward is not None for s in scores)
            stats.correct += sum(s.correct for s in scores)
            samples = []
            for text, tokens, finish in zip(pending.trace.completions, token_ids, pending.trace.finishes, strict=True):
                reason, source = self._finish(finish, len(tokens))
                stats.finish[reason] += 1
                stats.finish_from[source] += 1
                samples.append(Sample(token_ids=tokens + [eos] if reason == "stop" else tokens, token_logprobs=[],
                                      text=text, finish_reason=reason))
            stats.tokens += sum(len(s.token_ids) for s in samples)
            longest = max(len(s.token_ids) for s in samples)
            params = SamplingParams(n=len(samples), temperature=config.temperature, top_p=config.top_p,
                                    top_k=config.top_k, max_tokens=config.max_tokens or max(1, longest))
            groups.append(assemble_group(
                pending.problem, samples, scores, model_id=config.model_id, model_revision=config.model_revision,
                tokenizer_id=self.tokenizer_id, policy_step=pending.policy_step,
                generator_id=f"{GENERATOR_ID}:{pending.rule}", params=params,
                eos_token_ids={eos} if eos is not None else set(), group_id=pending.group_id,
                std_normalize=config.std_normalize, engine_logprobs_mode=NO_LOGPROBS, prompt_text=pending.prompt_text,
                prompt_token_ids=pending.trace.prompt_token_ids))
            problems.setdefault(pending.problem.prompt_id, pending.problem)
        stats.shards.append(self.sink.write(groups, list(problems.values())))
        stats.groups += len(groups)
        stats.rollouts += sum(len(g.rollouts) for g in groups)

    def _math_verify(self, batch: list[_Pending]) -> list[Score]:
        """math-verify's scores of every row with a gold (the rows it scores, and those whose run's own success it is
        compared with), in one call to the workers."""
        items = [(c, g) for p in batch for c, g in zip(p.trace.completions, p.golds, strict=True) if g is not None]
        if not items:
            return []
        if self.scorer is None:
            self.scorer = self.config.scoring.scorer()
        return self.scorer.score([c for c, _ in items], [g for _, g in items], self.extract)

    def _finish(self, stated: str | None, num_tokens: int) -> tuple[str, str]:
        """(finish reason, where it came from): the row's finish column, else the run's max_tokens (a completion
        reaching it was cut), else the configured one."""
        if stated is not None:
            return stated, "column"
        if self.config.max_tokens is not None:
            return ("length" if num_tokens >= self.config.max_tokens else "stop"), "max_tokens"
        return self.config.finish_reason, "stated"
