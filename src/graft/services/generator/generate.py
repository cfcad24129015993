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
from collections.abc import Callable, Generator, Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import pyarrow.parquet as pq
from tqdm import tqdm

from graft.rollouts.backends import load_backend
from graft.rollouts.datasets import load_problems
from graft.rollouts.files import checkpoint_step, latest_checkpoint
from graft.rollouts.groups import assemble_group, is_wanted_draw, make_group_id, wanted_group_id
from graft.rollouts.models import default_model_id, default_model_revision
from graft.rollouts.sampling import Backend, Sample, SamplingParams, report_tokens_on
from graft.rollouts.scoring import Score
from graft.rollouts.stopping import StopFlag
from graft.schemas import LeaseRequest, Problem, RolloutGroup, is_trainers_own
from graft.services.generator.config import GeneratorConfig

RETRY_INITIAL_S = 1.0  # continuous mode, store down: first pause before the call is tried again; doubles per failure
RETRY_MAX_S = 60.0  # the longest pause between tries (the outage itself may last any time)

log = logging.getLogger("graft.generator")
T = TypeVar("T")


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

    def count(self, groups: list[RolloutGroup], samples: list[list[Sample]], scores: list[Score]) -> None:
        """A sampled batch's groups, rollouts, tokens and how they scored."""
        flat = [s for group in samples for s in group]
        self.groups += len(groups)
        self.rollouts += len(flat)
        self.completion_tokens += sum(len(s.token_ids) for s in flat)
        self.correct += sum(s.correct for s in scores)
        self.scored += sum(s.reward is not None for s in scores)
        self.no_boxed_answer += sum(s.extracted_answer is None for s in scores)
        self.truncated += sum(s.finish_reason == "length" for s in flat)
        self.gold_unparsed += sum(s.reward is None for s in scores)

    def progress(self, started: float) -> dict[str, str]:
        """The progress bar's figures since `started` (perf_counter)."""
        elapsed = max(time.perf_counter() - started, 1e-9)
        return {"prompts/s": f"{self.groups / elapsed:.2f}", "tok/s": f"{self.completion_tokens / elapsed:.0f}",
                "success": f"{self.correct / max(self.scored, 1):.1%}"}

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
        """group id -> prompt id of the groups already stored for this model, revision and policy step, but those a
        trainer published of its own sampling (schemas.is_trainers_own): a generator that follows a trainer's
        checkpoints writes beside them under the trainer's model id (docker-compose's cotrain profile), and they are no earlier
        sampling of this generator's."""
        if self.is_lake:
            found = self.lake.reading.group_prompts(model_id, model_revision, policy_step)
        elif self.is_url:
            found = {}
            for page in self.client.iter_rollouts(model=model_id, min_policy_step=policy_step, max_policy_step=policy_step):
                for gid, prompt, revision, generator in zip(*(page.column(c).to_pylist() for c in (
                        "group_id", "prompt_id", "model_revision", "generator_id"))):
                    if revision == model_revision:
                        found[gid] = (prompt, generator)
        else:
            found = _stored_groups_in_shards(Path(self.store), model_id, model_revision, policy_step)
        return {gid: prompt for gid, (prompt, generator) in found.items()
                if not is_trainers_own(generator)}

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


def _stored_groups_in_shards(root: Path, model_id: str, model_revision: str,
                             policy_step: int) -> dict[str, tuple[str, str]]:
    """group id -> (prompt id, generator id) from every shard of the model, read with pyarrow (never the store's DuckDB
    file).

    A shard can vanish between listing and reading when the store compacts it into a new one;
    then list again, so that the new shard is read too.
    """
    directory = root / "rollouts" / f"model={model_id}"
    ids: dict[str, tuple[str, str]] = {}
    read: set[str] = set()
    while True:
        vanished = False
        for shard in sorted(directory.glob("part-*.parquet")):
            if shard.name in read:
                continue
            try:
                table = pq.read_table(shard, columns=["group_id", "prompt_id", "model_revision", "policy_step",
                                                      "generator_id"])
            except FileNotFoundError:
                vanished = True
                continue
            read.add(shard.name)
            for gid, prompt, revision, step, generator in zip(*(table.column(c).to_pylist() for c in table.column_names)):
                if revision == model_revision and step == policy_step:
                    ids[gid] = (prompt, generator)
        if not vanished:
            return ids


class OtherSettingsStored(ValueError):
    """The store holds groups of this model, revision and policy step for this run's prompts that other settings
    sampled: resuming would mix two samplings under one model id."""


@dataclass(frozen=True)
class Policy:
    """The weights that sample, as the rows name them."""

    path: str  # what the backend loads: the config's model, or a checkpoint of watch_dir
    revision: str
    step: int

    @classmethod
    def first(cls, config: GeneratorConfig) -> Policy:
        """The config's model at its policy step, or (continuous mode) watch_dir's newest checkpoint when it is as new."""
        newest = newer_checkpoint(config, config.policy_step - 1)
        if newest is not None:
            return newest
        revision = config.model_revision or default_model_revision(config.model)
        return cls(config.model, revision, config.policy_step)


def newer_checkpoint(config: GeneratorConfig, step: int) -> Policy | None:
    """watch_dir's newest step_<N>/ checkpoint when N > step (continuous mode), else None."""
    if not (config.continuous and config.watch_dir):
        return None
    newest = latest_checkpoint(Path(config.watch_dir))
    if newest is None or checkpoint_step(newest) <= step:
        return None
    return Policy(str(newest), default_model_revision(newest), checkpoint_step(newest))


@dataclass
class Batch:
    """Prompts sampled, scored and stored together (one shard, one push, one lake transaction)."""

    problems: list[Problem]
    group_ids: list[str]
    problems_to_store: list[Problem] | None  # written with the groups: a wanted batch's, or the data set's once
    wanted: bool = False  # prompts learners want (follow_wanted), not the data set's

    @property
    def what(self) -> str:
        return f"the batch of {len(self.problems)} groups" + (" for wanted prompts" if self.wanted else "")


def batch_seed(seed: int, first_group_id: str) -> int:
    """A batch's sampling seed, derived from its first group's id (a data set's hex id, or a wanted draw's hex tail):
    a restart resamples a lost batch the same way."""
    return (seed + int(first_group_id.rsplit("-", 1)[-1][:8], 16)) % (2**31)


def run_generator(config: GeneratorConfig, stop: StopFlag | None = None) -> RunStats:
    """Sample, score and store groups as `config` says; returns what was done.

    SIGTERM/SIGINT (when called from the main thread), or setting `stop.requested` from another
    thread, ends the run after the current batch is stored.
    """
    stop = stop or StopFlag()
    stop.install()
    try:
        with GeneratorRun(config, stop) as run:
            for batch in run.batches():
                run.store(batch, run.sample(batch))
                if run.finished():
                    break
        return run.stats
    finally:
        stop.uninstall()


class GeneratorRun:
    """One graft-generate run, its state in one object: what it samples (the problems, the sampling and its key), the
    policy that samples and the backend running it, the sink, the ids stored already (which the rounds skip) and the
    counts. Opened as a context (the sink, the scorer, the bar, the backend, then the stored ids), closed backend first:
    vLLM logs its shutdown to stdout, before the caller prints its summary."""

    def __init__(self, config: GeneratorConfig, stop: StopFlag):
        self.started = time.perf_counter()
        self.config, self.stop, self.stats = config, stop, RunStats()
        self.problems = load_problems(config.dataset, limit=config.dataset_limit, problem_field=config.problem_field,
                                      answer_field=config.answer_field)
        if not self.problems:
            raise ValueError(f"dataset {config.dataset} holds no problems")
        self.model_id = config.model_id or default_model_id(config.model)
        self.generator_id = config.generator_id or f"{socket.gethostname()}-{os.getpid()}"
        self.key = config.sampling_key()
        self.params = SamplingParams(n=config.group_size, temperature=config.temperature, top_p=config.top_p,
                                     top_k=config.top_k, max_tokens=config.max_tokens)
        self.policy = Policy.first(config)
        self.stored: set[str] = set()  # ids of the policy's stored groups, for the rounds still to come
        self.dataset_stored = False  # whether the data set's problems went to the store (with its first batch)
        self.backend: Backend | None = None
        self._resources = ExitStack()

    # ---- opening and closing ----------------------------------------------------------------------------------
    def __enter__(self) -> GeneratorRun:
        with ExitStack() as resources:
            self.sink = resources.enter_context(closing(GroupSink(self.config.store, self.config.store_token)))
            self.scorer = resources.enter_context(self.config.scoring.scorer())  # sympy loads while the model does
            # rollouts, not groups: a batch of groups can take minutes on a CPU (and the sampler's tokens show meanwhile)
            self.bar = resources.enter_context(tqdm(
                disable=not self.config.progress, unit="rollout", dynamic_ncols=True,
                total=None if self.config.continuous else len(self.problems) * self.config.rounds * self.config.group_size))
            resources.callback(self._close_backend)
            self._load_backend()
            self.stored = self._stored_ids()
            self._resources = resources.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self.stats.stored_ids_held = len(self.stored)
        self.stats.server = self.backend.server_counts() if self.backend is not None else None
        self._resources.close()
        self.stats.wall_s = time.perf_counter() - self.started

    def _load_backend(self) -> None:
        self.backend = load_backend(self.config.sampler, self.policy.path, model_id=self.model_id,
                                    seed=self.config.seed or 0)
        if not self.bar.disable:
            self.backend.on_tokens = report_tokens_on(self.bar)

    def _close_backend(self) -> None:
        backend, self.backend = self.backend, None  # closed once, even when a reload fails
        if backend is not None:
            backend.close()

    # ---- what to sample -----------------------------------------------------------------------------------------
    def batches(self) -> Iterator[Batch]:
        """The batches to sample, in order: round after round of the data set's prompts not stored yet (rounds count up
        from 0, and a restart fills the gaps first; continuous mode goes on without end, or until a stop is asked for),
        each batch after one of the prompts learners want when following them; after a batch, a newer checkpoint of
        watch_dir reloads the backend and the rounds start again for its policy step."""
        round_index = 0
        while not self.stop.requested and (self.config.continuous or round_index < self.config.rounds):
            reloaded = yield from self._round(round_index)
            round_index = 0 if reloaded else round_index + 1

    def _round(self, round_index: int) -> Generator[Batch, None, bool]:
        """One round's batches; True when a newer checkpoint ended it."""
        ids = {p.prompt_id: self.group_id(p.prompt_id, round_index) for p in self.problems}
        pending = [p for p in self.problems if ids[p.prompt_id] not in self.stored]
        self.stats.skipped_already_stored += len(self.problems) - len(pending)
        self.bar.update((len(self.problems) - len(pending)) * self.config.group_size)
        for start in range(0, len(pending), self.config.prompts_per_batch):
            if self.config.follow_wanted:  # learners' misses first: one batch of them before each of the data set's
                wanted = self.wanted_batch()
                if wanted is not None:
                    yield wanted
            problems = pending[start : start + self.config.prompts_per_batch]
            yield Batch(problems, [ids[p.prompt_id] for p in problems], None if self.dataset_stored else self.problems)
            newer = newer_checkpoint(self.config, self.policy.step)
            if newer is not None:
                self.reload(newer)
                return True
        if self.config.continuous and not pending:
            time.sleep(self.config.idle_sleep_s)  # nothing was left in this round; never spin
        # Rounds only go up until a reload reads the ids afresh: this round's are never asked again, and a continuous
        # run that kept them all would grow without end.
        self.stored.difference_update(ids.values())
        return False

    def wanted_batch(self) -> Batch | None:
        """follow_wanted: a batch of the prompts learners want, leased to this generator alone (no other samples them
        meanwhile; the lease ends when its group is in the store, or after wanted_lease_s); None when none is wanted.
        A group the wanting learner would not take (all-fail, say) leaves its want open: it is leased again, to this
        generator or another."""
        lease = LeaseRequest(model_id=self.model_id, generator_id=self.generator_id, limit=self.config.prompts_per_batch,
                             order=self.config.wanted_order, lease_s=self.config.wanted_lease_s)
        listed = self._through_outages(lambda: self.sink.client.lease_wanted(lease), "leasing wanted prompts")
        problems = [Problem(prompt_id=p.prompt_id, dataset=p.dataset, problem=p.problem, answer=p.answer)
                    for p in listed.prompts]
        if not problems:
            return None
        # a fresh id per draw (a want whose first group was all-fail is sampled again under another), which names the
        # settings: a restart knows it as its own
        draw = f"{self.generator_id}-{time.time_ns()}"
        ids = [wanted_group_id(self.model_id, self.policy.revision, self.policy.step, p.prompt_id, draw, self.key)
               for p in problems]
        return Batch(problems, ids, problems, wanted=True)

    def group_id(self, prompt_id: str, round_index: int) -> str:
        """The id of the prompt's group of this round under this policy and these settings (deterministic)."""
        return make_group_id(self.model_id, self.policy.revision, self.policy.step, prompt_id, round_index, self.key)

    # ---- sampling and storing -------------------------------------------------------------------------------------
    def sample(self, batch: Batch, params: SamplingParams | None = None) -> list[RolloutGroup]:
        """One batch: generate, score, assemble; timings and counts go to `stats`. params: the run's, seeded per batch
        when the config gives a seed."""
        if params is None:
            params = self.params if self.config.seed is None else \
                replace(self.params, seed=batch_seed(self.config.seed, batch.group_ids[0]))
        backend = self.backend
        prompts = [self.config.prompt.render(backend.tokenizer, p.problem) for p in batch.problems]
        t0 = time.perf_counter()
        samples = backend.generate(prompts, params)  # (prompts, n)
        t1 = time.perf_counter()
        scores = self.scorer.score([s.text for group in samples for s in group],
                                   [p.answer for p, group in zip(batch.problems, samples) for _ in group])
        t2 = time.perf_counter()
        groups = [assemble_group(
            problem, group_samples, scores[i * params.n : (i + 1) * params.n], model_id=self.model_id,
            model_revision=self.policy.revision, tokenizer_id=backend.tokenizer_id, policy_step=self.policy.step,
            generator_id=self.generator_id, params=params, eos_token_ids=backend.eos_token_ids,
            group_id=batch.group_ids[i], std_normalize=self.config.std_normalize,
            engine_logprobs_mode=backend.logprobs_mode,
        ) for i, (problem, group_samples) in enumerate(zip(batch.problems, samples))]
        self.stats.sampling_s += t1 - t0
        self.stats.scoring_s += t2 - t1
        self.stats.assembly_s += time.perf_counter() - t2
        self.stats.count(groups, samples, scores)
        return groups

    def store(self, batch: Batch, groups: list[RolloutGroup]) -> None:
        """Write the batch's groups (whole or not at all: one shard, push or transaction), through a store outage in
        continuous mode; the ids go to those the round skips."""
        t0 = time.perf_counter()
        self.stats.shards.append(self._through_outages(lambda: self.sink.write(groups, batch.problems_to_store),
                                                       batch.what))
        self.stats.writing_s += time.perf_counter() - t0
        self.stats.batches += 1
        if batch.wanted:
            informative = sum(g.informative for g in groups)
            self.stats.wanted_groups += len(groups)
            self.stats.wanted_informative += informative
            log.info("sampled %d wanted prompts: %d informative groups", len(groups), informative)
        else:
            self.dataset_stored = True
            self.stored.update(batch.group_ids)
        self.bar.update(len(groups) * self.config.group_size)
        self.bar.set_postfix(self.stats.progress(self.started), refresh=False)

    def finished(self) -> bool:
        """Whether the run ends after the batch just stored: a stop was asked for, or max_batches are stored."""
        return self.stop.requested or (self.config.max_batches is not None
                                       and self.stats.batches >= self.config.max_batches)

    def reload(self, policy: Policy) -> None:
        """Sample from now on with `policy` (a newer checkpoint): the backend reloaded, its stored ids read afresh."""
        previous = self.policy.step
        self._close_backend()
        self.policy = policy
        self._load_backend()
        # a warning: the CLI logs at that level, and a model changed mid-run must show in its log
        log.warning("reloaded the newer checkpoint %s: policy step %d -> %d", policy.path, previous, policy.step)
        self.stored = self._stored_ids()
        self.stats.reloads += 1

    # ---- the store ----------------------------------------------------------------------------------------------
    def _stored_ids(self) -> set[str]:
        """The ids of the groups stored already for this model, revision and policy step, which the rounds skip;
        OtherSettingsStored when a stored group of this run's prompts is not one its settings make (group ids hold
        `GeneratorConfig.sampling_key`; a wanted prompt's draws name it: `wanted_group_id`)."""
        policy = self.policy
        stored = self._through_outages(lambda: self.sink.stored_groups(self.model_id, policy.revision, policy.step),
                                       "reading the stored group ids")
        ours = {p.prompt_id for p in self.problems}
        per_prompt: dict[str, list[str]] = {}
        for group_id, prompt in stored.items():
            if prompt in ours and not is_wanted_draw(group_id, self.key):
                per_prompt.setdefault(prompt, []).append(group_id)
        others, prompts = 0, 0
        for prompt, group_ids in per_prompt.items():
            # a prompt's rounds are stored from 0 up (a restart fills the gaps first): its ids are among the first ones
            mine = {self.group_id(prompt, r) for r in range(len(group_ids) + self.config.rounds)}
            foreign = sum(g not in mine for g in group_ids)
            others, prompts = others + foreign, prompts + bool(foreign)
        if others:
            raise OtherSettingsStored(
                f"the store holds {others} group(s) of model {self.model_id} (revision {policy.revision}, policy step "
                f"{policy.step}) for {prompts} of this run's {len(self.problems)} prompts that other settings sampled "
                "(another few_shot, template, instruction, system_prompt, answer_field, group_size, temperature, top_p, "
                "top_k, max_tokens or std_normalize, or a graft version whose group ids did not hold them): this run "
                "would store a second sampling under the same model id beside the first. Store it under a model id of "
                f"its own, e.g. --model-id {self.model_id}-{self.key[:6]}, or run with the first run's settings to "
                "resume that one")
        return set(stored)

    def _through_outages(self, call: Callable[[], T], what: str) -> T:
        """call() of the store; in continuous mode through an outage of any length: what the run holds (the sampled
        batch) is kept and the call tried again after RETRY_INITIAL_S, doubling up to RETRY_MAX_S, each failure logged.
        A one-shot run raises at once; a stop asked for during the outage gets one more try, then raises (the batch is
        not stored: a restart samples it again, its group ids are deterministic)."""
        sink, stop = self.sink, self.stop
        pause, failures, began = RETRY_INITIAL_S, 0, time.monotonic()
        while True:
            try:
                result = call()
            except sink.outages as error:
                if not self.config.continuous or stop.requested:
                    if failures:
                        log.error("store %s still down after %d tries over %.0f s and a stop was asked for: %s failed",
                                  sink.store, failures + 1, time.monotonic() - began, what)
                    raise
                failures += 1
                self.stats.store_retries += 1
                log.warning("store %s is down (%s); %s: kept, try %d in %.0f s", sink.store, error, what, failures + 1,
                            pause)
                resume_at = time.monotonic() + pause
                while not stop.requested and time.monotonic() < resume_at:  # SIGTERM cuts the pause short
                    time.sleep(min(0.2, max(0.0, resume_at - time.monotonic())))
                pause = min(2 * pause, RETRY_MAX_S)
                continue
            if failures:
                log.warning("store %s is back after %.0f s: %s done", sink.store, time.monotonic() - began, what)
            return result
