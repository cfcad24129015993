"""The loop behind `graft-rescore`: read a model's stored groups from a store root, teacher-force each through the
peer's weights (`graft.rollouts.rescoring`) at the sampling its rows state, write the rescored groups as new shards
(atomically, through graft-generate's sink). The source shards are never touched; a rescored group has an id
derived from its source's, the weights and the sampling, so a second run skips what the first stored.

Each group is conditioned on the prompt its trace followed: the rows' `prompt_token_ids` when they are the rescoring
tokenizer's, else their `prompt_text`, else the prompt graft-generate would build from the problem (`template`, ...).
Rows are 'rescored' when the weights are shown to be the trace's author (their fingerprint is the source rows'
`model_revision`: graft-generate's rows, or an import that stated it), else 'rescored_unverified'."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from graft.rollouts.backends import load_backend
from graft.rollouts.datasets import load_problems
from graft.rollouts.models import default_model_revision, load_model_and_tokenizer, tokenizer_fingerprint
from graft.rollouts.rescoring import HFRescorer, Rescorer, ServedRescorer, rescore_group, rescored_group_id
from graft.rollouts.sampling import SamplingParams
from graft.schemas import NO_LOGPROBS, RESCORED, RESCORED_UNVERIFIED, Problem, RolloutGroup, table_to_groups
from graft.services.generator.config import RescoreConfig
from graft.services.generator.generate import GroupSink


@dataclass
class RescoreStats:
    groups_read: int = 0  # the source model's groups in the store
    groups: int = 0  # rescored and stored by this run
    rollouts: int = 0
    tokens: int = 0
    skipped_with_mu: int = 0  # groups that carry mu already (only_without_mu)
    skipped_already_stored: int = 0  # rescored by an earlier run
    groups_failed: int = 0  # a group that could not be rescored (one line each)
    refused_sampling: int = 0  # of those, groups whose stated sampling the rescorer cannot apply
    temperatures: set[float] = field(default_factory=set)  # the rows' stated temperatures
    prompts_from: Counter = field(default_factory=Counter)  # prompt_token_ids / prompt_text / rebuilt -> groups
    modes: Counter = field(default_factory=Counter)  # rescored / rescored_unverified -> groups
    shards: list[str] = field(default_factory=list)
    scoring_s: float = 0.0
    wall_s: float = 0.0

    def summary(self, backend: str) -> dict:
        return {
            "groups_read": self.groups_read, "groups": self.groups, "rollouts": self.rollouts, "tokens": self.tokens,
            "skipped_with_mu": self.skipped_with_mu, "skipped_already_stored": self.skipped_already_stored,
            "groups_failed": self.groups_failed, "refused_sampling": self.refused_sampling, "backend": backend,
            "logprobs_mode": dict(self.modes), "prompts_from": dict(self.prompts_from),
            "temperatures": sorted(self.temperatures), "tokens_per_s": self.tokens / self.scoring_s if self.scoring_s else None,
            "shards": len(self.shards), "wall_s": round(self.wall_s, 3),
        }


def run_rescore(config: RescoreConfig, on_failed_group: Callable[[str], None] = print) -> RescoreStats:
    """Rescore the source model's stored groups as `config` says; a group that cannot be rescored is reported to
    `on_failed_group` in one line and left out."""
    started = time.perf_counter()
    stats = RescoreStats()
    root = Path(config.store).expanduser()
    if config.store.startswith(("http://", "https://", "ducklake:")) or not (root / "rollouts").is_dir():
        raise ValueError(f"store: {config.store} is not a store root directory (a folder holding rollouts/): "
                         "graft-rescore reads the shards it rescores from the store's folder")
    sources = _source_groups(root, config, stats)
    problems = _problems(root, config)
    rescorer = _rescorer(config)
    model_id = config.model_id or config.source_model
    weights = _weights_fingerprint(config.model)
    revision = config.model_revision or weights or default_model_revision(config.model)
    sink = GroupSink(str(root), None)
    stored: dict[int, set[str]] = {}
    batch: list[RolloutGroup] = []
    try:
        for group in sources:
            first = group.rollouts[0]
            # the rows' own sampling, as written (float32 columns: 0.699999988 read back as 0.7)
            params = SamplingParams(n=len(group.rollouts), temperature=_as_written(first.temperature),
                                    top_p=_as_written(first.top_p), top_k=first.top_k)
            step = first.policy_step
            if step not in stored:
                stored[step] = set(sink.stored_groups(model_id, revision, step))
            if rescored_group_id(group.group_id, model_id, revision, params) in stored[step]:
                stats.skipped_already_stored += 1
                continue
            refusal = rescorer.cannot_apply(params)
            if refusal is not None:
                stats.groups_failed += 1
                stats.refused_sampling += 1
                on_failed_group(f"group {group.group_id}: {refusal}")
                continue
            prompt = _prompt_followed(group, rescorer, problems, config)
            if isinstance(prompt, str):
                stats.groups_failed += 1
                on_failed_group(f"group {group.group_id}: {prompt}")
                continue
            prompt_ids, prompt_text, source = prompt
            # shown to be the trace's author: these weights' fingerprint is the revision the source rows state
            mode = RESCORED if weights is not None and weights == first.model_revision else RESCORED_UNVERIFIED
            t0 = time.perf_counter()
            try:
                rescored = rescore_group(group, prompt_ids, rescorer, params, model_id=model_id,
                                         model_revision=revision, mode=mode, prompt_text=prompt_text)
            except ValueError as error:
                stats.groups_failed += 1
                on_failed_group(f"group {group.group_id}: {error}")
                continue
            stats.scoring_s += time.perf_counter() - t0
            stats.prompts_from[source] += 1
            stats.modes[mode] += 1
            stats.temperatures.add(params.temperature)
            stats.tokens += sum(r.num_tokens for r in rescored.rollouts)
            batch.append(rescored)
            if len(batch) >= config.groups_per_shard:
                _write(sink, batch, problems, stats)
        if batch:
            _write(sink, batch, problems, stats)
    finally:
        sink.close()
        rescorer.close()
        stats.wall_s = time.perf_counter() - started
    return stats


def _weights_fingerprint(model: str) -> str | None:
    """The fingerprint of the weights at `model` (graft-generate's default revision), None for a folder without
    weights (a served model's tokenizer): then nothing shows whose weights scored the rows."""
    try:
        return default_model_revision(model)
    except ValueError:
        return None


def _prompt_followed(group: RolloutGroup, rescorer: Rescorer, problems: dict[str, Problem],
                     config: RescoreConfig) -> tuple[list[int], str | None, str] | str:
    """(prompt ids in the rescorer's vocabulary, the prompt's text, where it came from) of the prompt the group's trace
    followed, or why it is unknown: the rows' prompt_token_ids when they are the rescorer's tokenizer's, else their
    prompt_text, else the prompt graft-generate builds from the problem."""
    first = group.rollouts[0]
    if first.prompt_token_ids and first.tokenizer_id == rescorer.tokenizer_id:
        return list(first.prompt_token_ids), first.prompt_text, "prompt_token_ids"
    if first.prompt_text:
        return rescorer.tokenizer(first.prompt_text, add_special_tokens=False)["input_ids"], first.prompt_text, \
            "prompt_text"
    problem = problems.get(group.prompt_id)
    if problem is None:
        return (f"its rows keep no prompt and its prompt id {group.prompt_id} is neither in the store's prompts/ nor "
                f"in dataset {config.dataset}: set dataset to the problems the traces answered")
    prompt = config.prompt.render(rescorer.tokenizer, problem.problem)
    return rescorer.tokenizer(prompt, add_special_tokens=False)["input_ids"], prompt, "rebuilt"


def _as_written(stored: float) -> float:
    """A float32 column's value as it was written (0.699999988 -> 0.7): float32 holds 7 significant digits."""
    return float(f"{stored:.7g}")


def _write(sink: GroupSink, batch: list[RolloutGroup], problems: dict[str, Problem], stats: RescoreStats) -> None:
    stats.shards.append(sink.write(batch, list({g.prompt_id: problems[g.prompt_id] for g in batch}.values())))
    stats.groups += len(batch)
    stats.rollouts += sum(len(g.rollouts) for g in batch)
    batch.clear()


def _source_groups(root: Path, config: RescoreConfig, stats: RescoreStats) -> list[RolloutGroup]:
    """The source model's groups of the asked revision (those without mu only, unless told otherwise)."""
    groups = []
    for shard in sorted((root / "rollouts" / f"model={config.source_model}").glob("part-*.parquet")):
        for group in table_to_groups(pq.read_table(shard, partitioning=None)):
            if config.source_revision is not None and group.rollouts[0].model_revision != config.source_revision:
                continue
            stats.groups_read += 1
            if config.only_without_mu and group.rollouts[0].logprobs_mode != NO_LOGPROBS:
                stats.skipped_with_mu += 1
                continue
            groups.append(group)
    if not stats.groups_read:
        raise ValueError(f"{root} holds no groups of model {config.source_model}"
                         + (f" revision {config.source_revision}" if config.source_revision is not None else ""))
    return groups


def _problems(root: Path, config: RescoreConfig) -> dict[str, Problem]:
    """prompt id -> problem: the store's prompts/, then the dataset's."""
    found: dict[str, Problem] = {}
    for path in sorted((root / "prompts").glob("dataset=*/part-*.parquet")):
        for row in pq.read_table(path, partitioning=None).to_pylist():
            found.setdefault(row["prompt_id"], Problem(**row))
    if config.dataset:
        for problem in load_problems(config.dataset, problem_field=config.problem_field, answer_field=config.answer_field):
            found.setdefault(problem.prompt_id, problem)
    return found


def _rescorer(config: RescoreConfig) -> Rescorer:
    if config.sampler.backend == "openai":
        return ServedRescorer(load_backend(config.sampler, config.model))
    import torch

    from graft.rollouts.models import eos_token_ids

    model, tokenizer = load_model_and_tokenizer(config.model, dtype=getattr(torch, config.sampler.dtype))
    return HFRescorer(model, tokenizer, tokenizer_fingerprint(tokenizer), eos_token_ids(model, tokenizer))
