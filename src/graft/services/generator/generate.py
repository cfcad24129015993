"""The generation loop behind `graft-generate`: sample groups, score, assemble, store; resumable.

Group ids are deterministic in (model, revision, policy step, prompt, round), so a restarted run
reads what is already stored (the shards under `<root>/rollouts/model=<id>/`, or the store API)
and samples only the rest: a crash and restart never duplicates or loses a group. A batch becomes
one shard (or one push), written atomically, so a batch is stored whole or not at all.
Continuous mode keeps sampling and, between batches, reloads the model when the watched folder
holds a newer `step_<N>/` checkpoint, storing N as the rows' policy step; a store (URL or lake) that
is down keeps the batch in hand and is tried again with a growing pause, however long the outage.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
from tqdm import tqdm

from graft.rollouts.backends import load_backend
from graft.rollouts.datasets import load_problems
from graft.rollouts.files import checkpoint_step, latest_checkpoint
from graft.rollouts.groups import assemble_group, is_wanted_draw, make_group_id, wanted_group_id
from graft.rollouts.hf_backend import report_tokens_on
from graft.rollouts.models import default_model_id, default_model_revision
from graft.rollouts.openai_backend import OpenAIBackend
from graft.rollouts.prompts import build_prompt
from graft.rollouts.sampling import Backend, SamplingParams
from graft.rollouts.scoring import Scorer
from graft.rollouts.stopping import StopFlag
from graft.schemas import LeaseRequest, Problem, RolloutGroup
from graft.services.generator.config import GeneratorConfig

RETRY_INITIAL_S = 1.0  # continuous mode, store down: first pause before the call is tried again; doubles per failure
RETRY_MAX_S = 60.0  # the longest pause between tries (the outage itself may last any time)

log = logging.getLogger("graft.generator")


@dataclass
class RunStats:
    """What a run did, and where its wall time went."""

    groups: int = 0
    rollouts: int = 0
    completion_tokens: int = 0
    correct: int = 0
    scored: int = 0  # rollouts with a reward (the gold parsed)
    no_boxed_answer: int = 0  # rollouts with no \boxed{} answer: reward 0 whatever they wrote
    truncated: int = 0  # rollouts cut at max_tokens (finish_reason 'length')
    gold_unparsed: int = 0  # rollouts whose gold math-verify could not parse: no reward (null)
    batches: int = 0
    skipped_already_stored: int = 0
    reloads: int = 0
    store_retries: int = 0  # store calls tried again after an outage (continuous mode)
    wanted_groups: int = 0  # groups sampled for wanted prompts (follow_wanted)
    wanted_informative: int = 0  # of those, informative ones (each clears the wants of learners whose rule takes it)
    stored_ids_held: int = 0  # ids of stored groups the run still checked against at its end (one round's, at most)
    server: dict[str, float] | None = None  # backend openai: requests, retries, tokens and time (RequestCounts)
    sampling_s: float = 0.0
    scoring_s: float = 0.0
    assembly_s: float = 0.0
    writing_s: float = 0.0
    wall_s: float = 0.0
    shards: list[str] = field(default_factory=list)

    @property
    def outside_sampling_share(self) -> float:
        """Share of the batches' wall time spent scoring, assembling and writing."""
        busy = self.sampling_s + self.scoring_s + self.assembly_s + self.writing_s
        return 0.0 if busy == 0 else (busy - self.sampling_s) / busy


class GroupSink:
    """Where groups go: shards under a store root (atomic files), the store's push API, or a lake (`ducklake:...`:
    one transaction per batch; data path and S3 settings from GRAFT_LAKE_* / AWS_*)."""

    def __init__(self, store: str, token: str | None):
        from graft.services.store_api.targets import is_lake_target  # no DuckDB import unless the target is a lake

        self.is_url = store.startswith(("http://", "https://"))
        self.is_lake = is_lake_target(store)
        self.store = store
        self.outages: tuple[type[Exception], ...] = ()  # what a store that is down (for now) raises
        if self.is_url:
            from graft.services.store_api.http.client import StoreClient, StoreUnavailable

            self.client = StoreClient(store, token=token)
            self.outages = (StoreUnavailable,)
        elif self.is_lake:
            from graft.services.store_api.lake import Lake, LakeConfig, LakeUnavailable

            self.lake = Lake(LakeConfig(catalog=store)).open()
            self.outages = (LakeUnavailable,)
        else:
            Path(store).mkdir(parents=True, exist_ok=True)

    def stored_groups(self, model_id: str, model_revision: str, policy_step: int) -> dict[str, str]:
        """group id -> prompt id of the groups already stored for this model, revision and policy step."""
        if self.is_lake:
            return self.lake.reading.group_prompts(model_id, model_revision, policy_step)
        if self.is_url:
            ids: dict[str, str] = {}
            for page in self.client.iter_rollouts(model=model_id, min_policy_step=policy_step, max_policy_step=policy_step):
                for gid, prompt, revision in zip(*(page.column(c).to_pylist()
                                                   for c in ("group_id", "prompt_id", "model_revision"))):
                    if revision == model_revision:
                        ids[gid] = prompt
            return ids
        return _stored_groups_in_shards(Path(self.store), model_id, model_revision, policy_step)

    def write(self, groups: list[RolloutGroup], problems: list[Problem] | None) -> str:
        if self.is_url:
            response = self.client.push_groups(groups, problems)
            return response.shard or ""
        if self.is_lake:
            from graft.services.store_api.tables import groups_table, validate_table

            result = self.lake.writing.commit(validate_table(groups_table(groups)), problems or [])
            return f"lake: {result.accepted_groups} groups committed"
        from graft.services.store_api.local import write_groups

        return str(write_groups(self.store, groups, problems))

    def close(self) -> None:
        if self.is_url:
            self.client.close()
        elif self.is_lake:
            self.lake.close()


def _stored_groups_in_shards(root: Path, model_id: str, model_revision: str, policy_step: int) -> dict[str, str]:
    """Read the group ids of every shard of the model with pyarrow (never the store's DuckDB file).

    A shard can vanish between listing and reading when the store compacts it into a new one;
    then list again, so that the new shard is read too.
    """
    directory = root / "rollouts" / f"model={model_id}"
    ids: dict[str, str] = {}
    read: set[str] = set()
    while True:
        vanished = False
        for shard in sorted(directory.glob("part-*.parquet")):
            if shard.name in read:
                continue
            try:
                table = pq.read_table(shard, columns=["group_id", "prompt_id", "model_revision", "policy_step"])
            except FileNotFoundError:
                vanished = True
                continue
            read.add(shard.name)
            for gid, prompt, revision, step in zip(*(table.column(c).to_pylist() for c in table.column_names)):
                if revision == model_revision and step == policy_step:
                    ids[gid] = prompt
        if not vanished:
            return ids


class OtherSettingsStored(ValueError):
    """The store holds groups of this model, revision and policy step for this run's prompts that other settings
    sampled: resuming would mix two samplings under one model id."""


def _stored_ids_of_these_settings(
    stored: dict[str, str], problems: list[Problem], model_id: str, revision: str, policy_step: int, key: str,
    rounds: int,
) -> set[str]:
    """The stored group ids (group id -> prompt id) a resumed run skips; OtherSettingsStored when any stored group of
    this run's prompts is not one its settings make (group ids hold `GeneratorConfig.sampling_key`; a wanted prompt's
    draws name it: `wanted_group_id`)."""
    ours = {p.prompt_id for p in problems}
    per_prompt: dict[str, list[str]] = {}
    for group_id, prompt in stored.items():
        if prompt in ours and not is_wanted_draw(group_id, key):
            per_prompt.setdefault(prompt, []).append(group_id)
    others, prompts = 0, 0
    for prompt, group_ids in per_prompt.items():
        # a prompt's rounds are stored from 0 up (a restart fills the gaps first): its ids are among the first ones
        mine = {make_group_id(model_id, revision, policy_step, prompt, r, key) for r in range(len(group_ids) + rounds)}
        foreign = sum(g not in mine for g in group_ids)
        others, prompts = others + foreign, prompts + bool(foreign)
    if others:
        raise OtherSettingsStored(
            f"the store holds {others} group(s) of model {model_id} (revision {revision}, policy step {policy_step}) for "
            f"{prompts} of this run's {len(problems)} prompts that other settings sampled (another few_shot, template, "
            "instruction, system_prompt, answer_field, group_size, temperature, top_p, top_k, max_tokens or "
            "std_normalize, or a graft version whose group ids did not hold them): this run would store a second "
            "sampling under the same model id beside the first. Store it under a model id of its own, e.g. "
            f"--model-id {model_id}-{key[:6]}, or run with the first run's settings to resume that one")
    return set(stored)


def through_outages(sink: GroupSink, call, what: str, config: GeneratorConfig, stop: StopFlag, stats: RunStats):
    """call() of the store; in continuous mode through an outage of any length: what the run holds (the sampled batch)
    is kept and the call tried again after RETRY_INITIAL_S, doubling up to RETRY_MAX_S, each failure logged. A
    one-shot run raises at once; a stop asked for during the outage gets one more try, then raises (the batch is not
    stored: a restart samples it again, its group ids are deterministic)."""
    pause, failures, began = RETRY_INITIAL_S, 0, time.monotonic()
    while True:
        try:
            result = call()
        except sink.outages as error:
            if not config.continuous or stop.requested:
                if failures:
                    log.error("store %s still down after %d tries over %.0f s and a stop was asked for: %s failed",
                              sink.store, failures + 1, time.monotonic() - began, what)
                raise
            failures += 1
            stats.store_retries += 1
            log.warning("store %s is down (%s); %s: kept, try %d in %.0f s", sink.store, error, what, failures + 1, pause)
            resume_at = time.monotonic() + pause
            while not stop.requested and time.monotonic() < resume_at:  # SIGTERM cuts the pause short
                time.sleep(min(0.2, max(0.0, resume_at - time.monotonic())))
            pause = min(2 * pause, RETRY_MAX_S)
            continue
        if failures:
            log.warning("store %s is back after %.0f s: %s done", sink.store, time.monotonic() - began, what)
        return result


def run_generator(config: GeneratorConfig, stop: StopFlag | None = None) -> RunStats:
    """Sample, score and store groups as `config` says; returns what was done.

    SIGTERM/SIGINT (when called from the main thread), or setting `stop.requested` from another
    thread, ends the run after the current batch is stored.
    """
    stop = stop or StopFlag()
    stop.install()
    try:
        return _run(config, stop)
    finally:
        stop.uninstall()


def _run(config: GeneratorConfig, stop: StopFlag) -> RunStats:
    started = time.perf_counter()
    stats = RunStats()
    problems = load_problems(config.dataset, limit=config.dataset_limit, problem_field=config.problem_field,
                             answer_field=config.answer_field)
    if not problems:
        raise ValueError(f"dataset {config.dataset} holds no problems")
    generator_id = config.generator_id or f"{socket.gethostname()}-{os.getpid()}"
    model_id = config.model_id or default_model_id(config.model)
    model_path, policy_step = config.model, config.policy_step
    if config.continuous and config.watch_dir:
        newest = latest_checkpoint(Path(config.watch_dir))
        if newest is not None and checkpoint_step(newest) >= policy_step:
            policy_step, model_path = checkpoint_step(newest), str(newest)
    revision = config.model_revision if model_path == config.model and config.model_revision else default_model_revision(model_path)
    key = config.sampling_key()
    params = SamplingParams(
        n=config.group_size, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
        max_tokens=config.max_tokens, seed=None,
    )

    sink = GroupSink(config.store, config.store_token)
    # The scoring workers import sympy while the model loads.
    scorer = Scorer(num_workers=config.score_workers, timeout_s=config.score_timeout_s)
    # rollouts, not groups: a batch of groups can take minutes on a CPU (and the HF sampler's tokens show meanwhile)
    bar = tqdm(disable=not config.progress, unit="rollout", dynamic_ncols=True,
               total=None if config.continuous else len(problems) * config.rounds * config.group_size)
    stored: set[str] = set()
    backend = None
    try:
        backend = load_generator_backend(config, model_path, model_id, bar)
        stored = _stored_ids_of_these_settings(
            through_outages(sink, lambda: sink.stored_groups(model_id, revision, policy_step), "reading the stored group ids",
                            config, stop, stats),
            problems, model_id, revision, policy_step, key, config.rounds)
        problems_written = False
        round_index = 0
        with scorer:
            while not stop.requested:
                if not config.continuous and round_index >= config.rounds:
                    break
                pending = [p for p in problems if make_group_id(model_id, revision, policy_step, p.prompt_id, round_index, key) not in stored]
                stats.skipped_already_stored += len(problems) - len(pending)
                bar.update((len(problems) - len(pending)) * config.group_size)
                reload_to = None
                for start in range(0, len(pending), config.prompts_per_batch):
                    if config.follow_wanted:  # learners' misses first: one batch of them before each of the dataset's
                        _serve_wanted(sink, backend, scorer, params, config, model_id, revision, policy_step,
                                      generator_id, key, stop, stats)
                        if stop.requested:
                            break
                    batch = pending[start : start + config.prompts_per_batch]
                    group_ids = [make_group_id(model_id, revision, policy_step, p.prompt_id, round_index, key) for p in batch]
                    if config.seed is not None:
                        # Derived from the batch's first group: a restart resamples a lost batch the same way.
                        params.seed = (config.seed + int(group_ids[0][:8], 16)) % (2**31)
                    groups = sample_batch(backend, scorer, batch, group_ids, params, config, model_id, revision,
                                           policy_step, generator_id, stats)
                    t0 = time.perf_counter()
                    stats.shards.append(through_outages(
                        sink, lambda: sink.write(groups, None if problems_written else problems),
                        f"the batch of {len(groups)} sampled groups", config, stop, stats))
                    stats.writing_s += time.perf_counter() - t0
                    problems_written = True
                    stored.update(group_ids)
                    stats.batches += 1
                    bar.update(len(groups) * config.group_size)
                    bar.set_postfix(_progress_postfix(stats, started), refresh=False)
                    if stop.requested or (config.max_batches is not None and stats.batches >= config.max_batches):
                        stop.requested = True
                        break
                    if config.continuous and config.watch_dir:
                        newest = latest_checkpoint(Path(config.watch_dir))
                        if newest is not None and checkpoint_step(newest) > policy_step:
                            reload_to = checkpoint_step(newest), newest
                            break
                if stop.requested:
                    break
                if reload_to is not None:
                    previous_step = policy_step
                    policy_step, model_path = reload_to[0], str(reload_to[1])
                    revision = default_model_revision(model_path)
                    backend_close = getattr(backend, "close", None)
                    if backend_close is not None:
                        backend_close()
                    backend = None  # closed: a failed reload must not close it twice in `finally`
                    backend = load_generator_backend(config, model_path, model_id, bar)
                    # a warning: the CLI logs at that level, and a model changed mid-run must show in its log
                    log.warning("reloaded the newer checkpoint %s: policy step %d -> %d", model_path, previous_step,
                                policy_step)
                    stored = _stored_ids_of_these_settings(
                        through_outages(sink, lambda: sink.stored_groups(model_id, revision, policy_step), "reading the stored group ids",
                                        config, stop, stats),
                        problems, model_id, revision, policy_step, key, config.rounds)
                    stats.reloads += 1
                    round_index = 0
                    continue
                if config.continuous and not pending:
                    time.sleep(config.idle_sleep_s)  # nothing was left in this round; never spin
                # Rounds only go up until a reload reads the ids afresh: this round's are never asked again, and a
                # continuous run that kept them all would grow without end.
                stored.difference_update(make_group_id(model_id, revision, policy_step, p.prompt_id, round_index, key)
                                         for p in problems)
                round_index += 1
    finally:
        stats.stored_ids_held = len(stored)
        if isinstance(backend, OpenAIBackend):
            stats.server = backend.counts.as_dict()
        # the engine stops here, before the caller prints its summary (vLLM logs its shutdown to stdout)
        if backend is not None and getattr(backend, "close", None) is not None:
            backend.close()
        scorer.close()
        bar.close()
        sink.close()
        stats.wall_s = time.perf_counter() - started
    return stats


def _serve_wanted(sink: GroupSink, backend: Backend, scorer: Scorer, params: SamplingParams,
                  config: GeneratorConfig, model_id: str, revision: str, policy_step: int, generator_id: str, key: str,
                  stop: StopFlag, stats: RunStats) -> None:
    """follow_wanted: sample and store one batch of the prompts learners want, leased to this generator alone (no other
    samples them meanwhile; the lease ends when its group is in the store, or after wanted_lease_s). A group the
    wanting learner would not take (all-fail, say) leaves its want open: it is leased again, to this generator or
    another."""
    lease = LeaseRequest(model_id=model_id, generator_id=generator_id, limit=config.prompts_per_batch,
                         order=config.wanted_order, lease_s=config.wanted_lease_s)
    listed = through_outages(sink, lambda: sink.client.lease_wanted(lease), "leasing wanted prompts", config, stop, stats)
    batch = [Problem(prompt_id=p.prompt_id, dataset=p.dataset, problem=p.problem, answer=p.answer) for p in listed.prompts]
    if not batch:
        return
    # a fresh id per draw (a want whose first group was all-fail is sampled again under another), which names the
    # settings: a restart knows it as its own
    draw = f"{generator_id}-{time.time_ns()}"
    group_ids = [wanted_group_id(model_id, revision, policy_step, p.prompt_id, draw, key) for p in batch]
    groups = sample_batch(backend, scorer, batch, group_ids, params, config, model_id, revision, policy_step,
                           generator_id, stats)
    t0 = time.perf_counter()
    stats.shards.append(through_outages(sink, lambda: sink.write(groups, batch),
                                        f"the batch of {len(groups)} groups for wanted prompts", config, stop, stats))
    stats.writing_s += time.perf_counter() - t0
    stats.batches += 1
    stats.wanted_groups += len(groups)
    informative = [g.prompt_id for g in groups if g.informative]
    stats.wanted_informative += len(informative)
    log.info("sampled %d wanted prompts: %d informative groups", len(groups), len(informative))


def load_generator_backend(config: GeneratorConfig, model_path: str, model_id: str, bar: tqdm | None = None) -> Backend:
    backend = load_backend(
        config.backend, model_path, model_id=model_id, dtype=config.dtype, hf_batch_size=config.hf_batch_size,
        vllm_max_model_len=config.vllm_max_model_len, vllm_gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        seed=config.seed or 0, openai=config.openai,
    )
    if bar is not None and not bar.disable and hasattr(backend, "on_tokens"):  # the HF sampler: progress within a batch
        backend.on_tokens = report_tokens_on(bar)
    return backend


def sample_batch(
    backend: Backend, scorer: Scorer, batch: list[Problem], group_ids: list[str], params: SamplingParams,
    config: GeneratorConfig, model_id: str, revision: str, policy_step: int, generator_id: str, stats: RunStats,
) -> list[RolloutGroup]:
    """One batch of prompts: generate, score, assemble; timings go to `stats`."""
    prompts = [render_prompt(config, backend.tokenizer, p.problem) for p in batch]
    t0 = time.perf_counter()
    samples = backend.generate(prompts, params)  # (prompts, n)
    t1 = time.perf_counter()
    texts = [s.text for group in samples for s in group]
    golds = [p.answer for p, group in zip(batch, samples) for _ in group]
    scores = scorer.score(texts, golds)
    t2 = time.perf_counter()
    groups = []
    for i, (problem, group_samples) in enumerate(zip(batch, samples)):
        groups.append(assemble_group(
            problem, group_samples, scores[i * params.n : (i + 1) * params.n],
            model_id=model_id, model_revision=revision, tokenizer_id=backend.tokenizer_id, policy_step=policy_step,
            generator_id=generator_id, params=params, eos_token_ids=backend.eos_token_ids, group_id=group_ids[i],
            std_normalize=config.std_normalize, engine_logprobs_mode=backend.logprobs_mode,
        ))
    t3 = time.perf_counter()
    stats.sampling_s += t1 - t0
    stats.scoring_s += t2 - t1
    stats.assembly_s += t3 - t2
    stats.groups += len(groups)
    stats.rollouts += len(texts)
    stats.completion_tokens += sum(len(s.token_ids) for group in samples for s in group)
    stats.correct += sum(s.correct for s in scores)
    stats.scored += sum(s.reward is not None for s in scores)
    stats.no_boxed_answer += sum(s.extracted_answer is None for s in scores)
    stats.truncated += sum(s.finish_reason == "length" for group in samples for s in group)
    stats.gold_unparsed += sum(s.reward is None for s in scores)
    return groups


def render_prompt(config: GeneratorConfig, tokenizer, problem: str) -> str:
    """The prompt the model sees for `problem` under the config's template, worked examples, instruction and system
    prompt (what `graft-generate --dry-run` shows)."""
    return build_prompt(tokenizer, problem, config.template, config.few_shot, config.instruction, config.system_prompt)


def _progress_postfix(stats: RunStats, started: float) -> dict[str, str]:
    elapsed = max(time.perf_counter() - started, 1e-9)
    return {
        "prompts/s": f"{stats.groups / elapsed:.2f}",
        "tok/s": f"{stats.completion_tokens / elapsed:.0f}",
        "success": f"{stats.correct / max(stats.scored, 1):.1%}",
    }
