"""Talking to the store without ever stopping training on it.

- `request`: the step's `PeerLookupRequest`, whose `accepts` is the rule of which peer group may be
  grafted; the store answers with the groups it accepts, the gate and the co-training wait apply it too.
- `start_lookup`: as soon as a step's prompts are known, one batch lookup for all of them runs in a
  background thread, so its latency hides behind generation; `peer_candidates` takes whatever arrived
  (co-training: waits a bounded time for the co-trainer's groups of the step's all-fail prompts).
- `publish`: in co-training mode every sampled group is pushed in the background; groups that
  could not be pushed wait in a bounded outbox and go with the next push.
- Lockstep co-training (store.cotrain_lockstep): every step waits for each partner's group of that very step for
  each of its prompts (`wait_for_step`), whatever the store's health, and fails naming the partner at the deadline
  (PartnerGone): what a step grafts does not depend on timing. Both trainers wait every step, so neither runs more than
  one step ahead, and the groups of the step are found among the most recent few.
- Replay (store.replay_from): `peer_candidates` hands the recorded groups instead (graft.trainer.replay).
- Co-training does not wait for the co-trainer while the store is known to be down, and counts
  (metric `cotrain_peer_silent_steps`) and warns about steps whose wait ran out with nothing from it.
- A store that is down, slow or erroring, or a response that is malformed in any way: the call fails
  in the background thread, the failure is counted and logged, further calls pause with exponential
  backoff, and the step goes on as GRPO.
  The first successful call after an outage resumes grafting.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

from graft.schemas import (
    MAX_LOOKUP_PROMPTS,
    MAX_PUSH_GROUPS,
    MAX_WANTS,
    PeerLookupRequest,
    Problem,
    RolloutGroup,
    ServedRequest,
    Want,
    WantedRequest,
)
from graft.services.store_api.http.client import StoreClient, StoreError
from graft.trainer.config import GraftConfig, StoreConfig
from graft.trainer.gate import GRAFT_ACTIONS, GateDecision, choose_peer_group, classify_group

log = logging.getLogger(__name__)
OUTBOX_LIMIT = 4096  # groups kept for publishing while the store is down; older ones are dropped (counted)
PEER_SILENT_WARN_STEPS = 5  # co-training steps in a row without a group from the co-trainer before a warning
NAN = float("nan")


@dataclass
class LookupResult:
    groups: dict[str, list[RolloutGroup]] = field(default_factory=dict)  # prompt id -> peer groups, most recent first
    ok: bool = False  # False when the store could not be asked or failed
    wait_s: float = 0.0  # how long the step waited for it (co-training's wait included)
    # Co-training: steps in a row (this one included) whose wait ran out with no group from the co-trainer; NaN when
    # not co-training or before anything is known (the store down)
    peer_silent_steps: float = NAN
    # prompt id -> why the store had no group of it to give (graft.schemas.api.MISS_REASONS); empty from an older store
    miss_reasons: dict[str, str] = field(default_factory=dict)


class PartnerGone(RuntimeError):
    """Lockstep co-training: a partner's groups of the step did not come before store.cotrain_wait_s ran out."""


@dataclass
class StoreCounters:
    """Cumulative counts since the trainer started; the loop logs per-step differences."""

    lookups: int = 0
    lookup_failures: int = 0
    lookups_skipped_backoff: int = 0
    lookups_late: int = 0  # not back when the gate needed them (offline: within store.lookup_wait_s, default 0)
    groups_published: int = 0
    publish_failures: int = 0
    groups_dropped_from_outbox: int = 0
    cotrain_waits_skipped: int = 0  # co-training waits not started: the store was known to be down
    wants_posted: int = 0  # all-fail prompts without a peer group posted to the store's wanted prompts (store.want_misses)
    served_posted: int = 0  # grafted groups posted to the store's served ledger (store.max_times_served, serve_order)
    broker_failures: int = 0  # those posts that failed (logged; the step went on)

    def since(self, previous: dict[str, int]) -> dict[str, int]:
        """The counts since `previous` (an earlier `dataclasses.asdict` of these), under their metric names store_*."""
        return {f"store_{name}": value - previous.get(name, 0) for name, value in dataclasses.asdict(self).items()}


@dataclass
class _Queued:
    """A group waiting in the outbox; `seq` names it, so that a push in flight removes what it pushed, by name."""

    seq: int
    group: RolloutGroup
    problem: Problem | None


class PeerExchange:
    """Background peer lookups and group publishing for one trainer."""

    def __init__(self, store: StoreConfig, graft: GraftConfig, learner_model: str,
                 stopping: Callable[[], bool] = lambda: False):
        if not store.url:
            raise ValueError("PeerExchange needs store.url")
        self.store, self.graft, self.learner_model = store, graft, learner_model
        # One client per thread: lookups and pushes never share a connection pool across threads.
        client_args = dict(token=store.token, timeout_s=store.timeout_s, retries=store.retries)
        self._lookup_client = StoreClient(store.url, **client_args)
        self._publish_client = StoreClient(store.url, **client_args)
        self._lookup_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graft-peer-lookup")
        self._publish_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graft-peer-publish")
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self._down_until = 0.0
        self._outbox: list[_Queued] = []  # oldest first
        self._next_seq = 0
        self._in_flight: set[int] = set()  # seqs of the outbox's groups a push is sending now
        self._publishing: Future | None = None
        self.counters = StoreCounters()
        self.stopping = stopping  # True once the trainer is asked to stop: co-training's wait ends early
        self.silent_steps = 0  # co-training: steps in a row whose wait ran out without a group from the co-trainer
        self.replay = None  # store.replay_from: the recorded run's groups (graft.trainer.replay.ReplaySource)

    # ---- store health -------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while backing off after a failed call."""
        return time.monotonic() >= self._down_until

    def _record_success(self) -> None:
        with self._lock:
            if self._consecutive_failures:
                log.warning("store %s is reachable again after %d failed calls: grafting resumes",
                            self.store.url, self._consecutive_failures)
            self._consecutive_failures = 0
            self._down_until = 0.0

    def _record_failure(self, what: str, error: Exception, unexpected: bool = False) -> None:
        """Back off; `unexpected` (not a store or network error) logs the traceback too: it points at a bug."""
        with self._lock:
            self._consecutive_failures += 1
            pause = min(self.store.backoff_initial_s * 2 ** (self._consecutive_failures - 1), self.store.backoff_max_s)
            self._down_until = time.monotonic() + pause
            log.warning("store %s: %s failed (%s: %s); training goes on without peers, next try in %.1f s",
                        self.store.url, what, type(error).__name__, error, pause, exc_info=unexpected)

    # ---- lookups ------------------------------------------------------------------------------
    def request(self, prompt_ids: list[str], learner_step: int) -> PeerLookupRequest | None:
        """The step's lookup for `prompt_ids`; its `accepts` is the rule the gate applies to what comes back.
        None without prompts (a data-parallel rank whose block of the step is empty): nothing to ask.

        A step may hold more prompts than one call takes: the request is validated on its first
        MAX_LOOKUP_PROMPTS and sent in chunks (`_lookup`)."""
        if not prompt_ids:
            return None
        unique = list(dict.fromkeys(prompt_ids))
        lag = self.graft.max_peer_policy_lag
        request = PeerLookupRequest(
            prompt_ids=unique[:MAX_LOOKUP_PROMPTS],
            learner_model=self.learner_model,
            peer_models=self.graft.peer_models,
            # With the union option, all-success peer groups are useful too (never all-fail ones).
            informative_only=not self.graft.union_all_success,
            min_successes=1,
            min_policy_step=max(0, learner_step - lag) if lag is not None else None,
            max_age_s=self.graft.max_peer_age_s,
            groups_per_prompt=self.store.groups_per_prompt,
            require_behaviour_logprobs=self.graft.require_behaviour_logprobs,
            max_times_served=self.store.max_times_served,
            order=self.store.serve_order,
        )
        return request.model_copy(update={"prompt_ids": unique})

    def start_lookup(self, request: PeerLookupRequest | None) -> Future | None:
        """Ask for the request's peer groups in the background; None while backing off (or with no request)."""
        if request is None or self.replay is not None or self.store.lockstep:
            return None  # lockstep looks up after sampling (an early lookup sees the step before); replay fetches by id
        if not self.available:
            with self._lock:
                self.counters.lookups_skipped_backoff += 1
            return None
        return self._lookup_pool.submit(self._lookup, request)

    def _lookup(self, request: PeerLookupRequest) -> LookupResult:
        result = LookupResult()
        with self._lock:
            self.counters.lookups += 1
        try:
            for begin in range(0, len(request.prompt_ids), MAX_LOOKUP_PROMPTS):
                chunk = request.model_copy(update={"prompt_ids": request.prompt_ids[begin : begin + MAX_LOOKUP_PROMPTS]})
                response = self._lookup_client.lookup_peer_groups(chunk, validate=False)
                for group in response.groups:
                    result.groups.setdefault(group.prompt_id, []).append(group)
                result.miss_reasons.update(getattr(response, "miss_reasons", None) or {})
        except Exception as error:  # noqa: BLE001 - whatever went wrong, this step runs as GRPO (counted, logged)
            # Besides a store that is down (StoreError, OSError) a response can be malformed in any way (a missing
            # column is a KeyError): none of it may stop training.
            with self._lock:
                self.counters.lookup_failures += 1
            self._record_failure("peer lookup", error, unexpected=not isinstance(error, (StoreError, OSError)))
            return LookupResult()
        self._record_success()
        result.ok = True
        return result

    def collect(self, pending: Future | None, wait_s: float) -> LookupResult:
        """The lookup's result if it is back within `wait_s` seconds (0: only if already back)."""
        if pending is None:
            return LookupResult()
        try:
            return pending.result(timeout=wait_s)
        except FutureTimeout:
            with self._lock:
                self.counters.lookups_late += 1
            return LookupResult()

    def wait_for_peers(self, request: PeerLookupRequest, deadline: float) -> LookupResult:
        """Co-training: look up the request's prompts repeatedly until each has a peer group (informative or
        not: the peer has sampled it), `deadline` passes, the store fails (it backs off: waiting longer would
        bring nothing) or the trainer is asked to stop.

        Returns what was found (prompt id -> groups, the gate picks; ok: some lookup answered); never raises on
        store trouble."""
        any_group = request.model_copy(update={
            "informative_only": False, "min_successes": 0, "groups_per_prompt": max(request.groups_per_prompt, 4)})
        found = LookupResult()
        if not self.available:  # known to be down (backing off): waiting cannot bring the co-trainer's groups
            with self._lock:
                self.counters.cotrain_waits_skipped += 1
            return found
        missing = list(dict.fromkeys(request.prompt_ids))
        while missing and time.monotonic() < deadline and self.available and not self.stopping():
            pending = self._lookup_pool.submit(self._lookup, any_group.model_copy(update={"prompt_ids": missing}))
            result = self.collect(pending, max(0.0, deadline - time.monotonic()))
            found.ok |= result.ok
            found.groups.update(result.groups)
            found.miss_reasons.update(result.miss_reasons)
            missing = [p for p in missing if p not in found.groups]
            if missing and self.available:
                # The co-trainer may be waiting for our groups as we wait for its: groups a failed push left queued go
                # again now, not after this wait.
                if self.outbox_size and (self._publishing is None or self._publishing.done()):
                    self._publishing = self._publish_pool.submit(self._flush)
                time.sleep(min(self.store.cotrain_poll_s, max(0.0, deadline - time.monotonic())))
        return found

    def wait_for_step(self, request: PeerLookupRequest, policy_step: int, deadline: float) -> LookupResult:
        """Lockstep co-training: look up the request's prompts until every model of graft.peer_models has published
        its group of `policy_step` for each (informative or not), through store trouble, until `deadline`; then
        PartnerGone, naming the partners and the prompts they owe. Returns exactly the groups of that step, by
        prompt, in group id order (the gate's choice among them depends on nothing else)."""
        partners = list(self.graft.peer_models or [])
        of_step = request.model_copy(update={
            "informative_only": False, "min_successes": 0, "min_policy_step": policy_step, "groups_per_prompt": 16})
        found = LookupResult(ok=True, peer_silent_steps=0.0)
        missing = list(dict.fromkeys(request.prompt_ids))
        while missing:
            if self.stopping():
                raise PartnerGone(f"lockstep co-training: asked to stop while waiting for the groups of step {policy_step} "
                                  f"of {', '.join(partners)}; the step is not trained (its groups would depend on when "
                                  "the signal came): continue with --resume")
            answer = self._lookup_pool.submit(self._lookup, of_step.model_copy(update={"prompt_ids": missing})).result()
            for prompt_id in list(missing):
                groups = sorted((g for g in answer.groups.get(prompt_id, [])
                                 if g.policy_step == policy_step and g.model_id in partners), key=lambda g: g.group_id)
                if {g.model_id for g in groups} >= set(partners):
                    found.groups[prompt_id] = groups
                    missing.remove(prompt_id)
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise PartnerGone(
                    f"lockstep co-training: {', '.join(partners)} published no group of step {policy_step} for {len(missing)} "
                    f"of this step's {len(request.prompt_ids)} prompts (e.g. {', '.join(missing[:3])}) within "
                    f"store.cotrain_wait_s = {self.store.cotrain_wait_s:g} s (store {self.store.url}"
                    + ("" if answer.ok else ", whose last lookup failed: see the warning above") + "). Is the partner "
                    "running, pushing to this store, and drawing the same prompts (same seed, data and "
                    "rollout.prompts_per_step)? The run stops rather than train the step without them; once the partner "
                    "is back, continue both with --resume")
            # Our groups of the step may still be queued (a failed push): the partner waits for them as we wait for its.
            if self.outbox_size and (self._publishing is None or self._publishing.done()):
                self._publishing = self._publish_pool.submit(self._flush)
            time.sleep(min(self.store.cotrain_poll_s, max(0.0, deadline - time.monotonic())))
        return found

    def note_cotrain_wait(self, waited: LookupResult | None, delivered: bool) -> float:
        """Count the step for the co-trainer's silence: `waited` is the wait's result (None: no wait was needed,
        `delivered` says whether the co-trainer's groups were there already). Returns the count, NaN while unknown."""
        if waited is None and not delivered:  # nothing asked of the co-trainer, or the store down: no word either way
            return float(self.silent_steps) if self.silent_steps else NAN
        if delivered or waited.groups:
            if self.silent_steps >= PEER_SILENT_WARN_STEPS:
                log.warning("co-training: the co-trainer's groups arrive again, after %d silent steps", self.silent_steps)
            self.silent_steps = 0
            return 0.0
        if not waited.ok:  # the store failed during the wait
            return float(self.silent_steps) if self.silent_steps else NAN
        self.silent_steps += 1
        if self.silent_steps == PEER_SILENT_WARN_STEPS or self.silent_steps % (5 * PEER_SILENT_WARN_STEPS) == 0:
            log.warning(
                "co-training: the co-trainer (peer models %s) has published no group of this trainer's all-fail prompts "
                "for %d steps (each waited up to store.cotrain_wait_s = %g s) although the store %s answers: is it running, "
                "and pushing to this store? Those prompts train as GRPO meanwhile (metric cotrain_peer_silent_steps)",
                self.graft.peer_models or "any", self.silent_steps, self.store.cotrain_wait_s, self.store.url)
        return float(self.silent_steps)

    # ---- the store as a broker: wants and the served ledger -----------------------------------
    def report(self, policy_step: int, decisions: list[GateDecision], found: LookupResult | None,
               problem_of: dict[str, Problem]) -> None:
        """After the gate: post the step's all-fail prompts that got no peer group to graft to the store's wanted
        prompts (store.want_misses), and the peer groups grafted to its served ledger (when the serving policy reads
        it), in the background, in order with the pushes; a failure is counted and logged, never fatal. Nothing
        when the lookup was not answered (the store down: its reasons are unknown) or in a replay."""
        if self.replay is not None or found is None or not found.ok:
            return
        wants = []
        if self.store.want_misses:
            for decision in decisions:
                if decision.action not in ("skip_no_peer", "skip_uninformative"):
                    continue
                reason = found.miss_reasons.get(decision.prompt_id) or (
                    "only_uninformative" if decision.action == "skip_uninformative" else "peers_not_admitted")
                wants.append(Want(prompt_id=decision.prompt_id, reason=reason, problem=problem_of[decision.prompt_id]))
        served = [d.peer_group.group_id for d in decisions if d.grafts] if self.store.records_served else []
        if not wants and not served:
            return
        self._publishing = self._publish_pool.submit(self._post_broker, policy_step, wants, served)

    def _post_broker(self, policy_step: int, wants: list[Want], served: list[str]) -> None:
        try:
            for begin in range(0, len(wants), MAX_WANTS):
                self._publish_client.post_wanted(WantedRequest(
                    learner_model=self.learner_model, policy_step=policy_step, wants=wants[begin:begin + MAX_WANTS]))
                with self._lock:
                    self.counters.wants_posted += len(wants[begin:begin + MAX_WANTS])
            for begin in range(0, len(served), MAX_WANTS):
                self._publish_client.record_served(ServedRequest(
                    learner_model=self.learner_model, policy_step=policy_step, group_ids=served[begin:begin + MAX_WANTS]))
                with self._lock:
                    self.counters.served_posted += len(served[begin:begin + MAX_WANTS])
        except Exception as error:  # noqa: BLE001 - as for pushes: counted, logged, never fatal
            with self._lock:
                self.counters.broker_failures += 1
            self._record_failure("posting wants and served groups", error,
                                 unexpected=not isinstance(error, (StoreError, OSError)))

    # ---- publishing ---------------------------------------------------------------------------
    def publish(self, groups: list[RolloutGroup], problems: list[Problem | None]) -> None:
        """Queue groups for the store and push the queue in the background (never blocks)."""
        with self._lock:
            for group, problem in zip(groups, problems):
                self._outbox.append(_Queued(self._next_seq, group, problem))
                self._next_seq += 1
            self._trim_outbox()
        if self.available:
            # Always queue a flush (the one worker runs them in order; one that finds the outbox empty returns at
            # once): skipping it while a push is in flight could strand these groups, since that push may have
            # read the outbox before they arrived, and a co-trainer waiting for them would wait for nothing.
            self._publishing = self._publish_pool.submit(self._flush)

    def _trim_outbox(self) -> None:
        """Drop the oldest groups beyond OUTBOX_LIMIT among those waiting (a push in flight keeps its own: they are
        counted published or, if it fails, wait again); with the lock held."""
        waiting = [entry.seq for entry in self._outbox if entry.seq not in self._in_flight]
        overflow = len(waiting) - OUTBOX_LIMIT
        if overflow > 0:
            dropped = set(waiting[:overflow])
            self._outbox = [entry for entry in self._outbox if entry.seq not in dropped]
            self.counters.groups_dropped_from_outbox += overflow

    def _flush(self) -> None:
        while True:
            with self._lock:
                batch = self._outbox[:MAX_PUSH_GROUPS]
                self._in_flight = {entry.seq for entry in batch}
            if not batch:
                return
            groups = [entry.group for entry in batch]
            problems = list({e.problem.prompt_id: e.problem for e in batch if e.problem is not None}.values())
            try:
                self._publish_client.push_groups(groups, problems=problems or None)
            except Exception as error:  # noqa: BLE001 - as for lookups: counted, retried later, never fatal
                with self._lock:
                    self.counters.publish_failures += 1
                    self._in_flight = set()
                    self._trim_outbox()
                self._record_failure("publishing groups", error, unexpected=not isinstance(error, (StoreError, OSError)))
                return
            self._record_success()
            with self._lock:
                # By name: publish() may have trimmed or added groups while this push was on its way.
                self._outbox = [entry for entry in self._outbox if entry.seq not in self._in_flight]
                self._in_flight = set()
                self.counters.groups_published += len(batch)

    def flush(self, timeout_s: float) -> bool:
        """Push what is queued, waiting at most `timeout_s`; True when the outbox is empty."""
        if self._publishing is not None:
            try:
                self._publishing.result(timeout=timeout_s)
            except FutureTimeout:
                return False
        if self._outbox and self.available:
            self._publishing = self._publish_pool.submit(self._flush)
            try:
                self._publishing.result(timeout=timeout_s)
            except FutureTimeout:
                return False
        return not self._outbox

    @property
    def outbox_size(self) -> int:
        with self._lock:
            return len(self._outbox)

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._publish_pool.shutdown(wait=False, cancel_futures=True)
        for client in (self._lookup_client, self._publish_client):
            close = getattr(client, "close", None)
            if close is not None:
                close()


def peer_candidates(
    peers: PeerExchange, pending: Future | None, request: PeerLookupRequest | None, groups: list[RolloutGroup],
    usable_tokenizers: set[str] | None, policy_step: int | None = None,
) -> LookupResult:
    """The peer groups the step's gate chooses from: the background lookup's answer (offline: if back within
    store.lookup_wait_s, by default only if already back) and, in co-training, what arrives within
    store.cotrain_wait_s for the all-fail prompts that have no group the gate would graft yet (the co-trainer may
    still be sampling them). Lockstep co-training: the partners' groups of `policy_step` for every prompt
    (`wait_for_step`); replay: the recorded run's groups of the step. No request (no prompts): nothing asked."""
    if request is None:
        return LookupResult(ok=True)
    started = time.monotonic()
    if peers.replay is not None:
        return peers.replay.lookup(policy_step + 1)  # recorded under the metrics' step, policy step + 1
    if peers.store.lockstep:
        found = peers.wait_for_step(request, policy_step, started + peers.store.cotrain_wait_s)
        found.wait_s = time.monotonic() - started
        return found
    cotrain = peers.store.mode == "cotrain"
    lookup = peers.collect(pending, wait_s=peers.store.cotrain_wait_s if cotrain else peers.store.lookup_wait_s)
    if cotrain:
        all_fail = [g.prompt_id for g in groups if classify_group([r.reward for r in g.rollouts]) == "all_fail"]
        missing = [p for p in all_fail
                   if choose_peer_group(lookup.groups.get(p, []), request, usable_tokenizers,
                                        trust_unverified_mu=peers.graft.trust_unverified_mu)[1] not in GRAFT_ACTIONS]
        waited = None
        if missing:
            deadline = started + peers.store.cotrain_wait_s
            waited = peers.wait_for_peers(request.model_copy(update={"prompt_ids": missing}), deadline)
            lookup.groups.update(waited.groups)
            lookup.miss_reasons.update(waited.miss_reasons)
        lookup.peer_silent_steps = peers.note_cotrain_wait(waited, delivered=bool(all_fail) and not missing)
    lookup.wait_s = time.monotonic() - started
    return lookup


# Why an all-fail group that the gate found no peer group for (skip_no_peer) got none: the store's miss reasons
# (graft.schemas.api.MISS_REASONS) but only_uninformative, which counts as groups_peer_uninformative; `unanswered`: the step's
# lookup failed, was late (store.lookup_wait_s) or was not sent (backing off); `unknown`: the store gave no reason (a
# store older than miss_reasons). Metrics groups_no_peer_<reason>; they add up to groups_no_peer.
NO_PEER_REASONS = ("nothing_stored", "only_learner", "peers_not_admitted", "only_without_mu", "served_out", "unanswered",
                   "unknown")


def no_peer_reasons(decisions: list[GateDecision], found: LookupResult | None) -> tuple[dict[str, int], int]:
    """(count per NO_PEER_REASONS, count of only_uninformative) over the decisions the gate skipped for want of a
    peer group ("skip_no_peer"), from what the step's lookup said of each prompt."""
    counts = dict.fromkeys(NO_PEER_REASONS, 0)
    uninformative = 0
    for decision in decisions:
        if decision.action != "skip_no_peer":
            continue
        if found is None or not found.ok:
            counts["unanswered"] += 1
            continue
        reason = found.miss_reasons.get(decision.prompt_id)
        if reason == "only_uninformative":
            uninformative += 1
        elif reason in counts:
            counts[reason] += 1
        elif decision.prompt_id in found.groups:  # groups came back, the gate admitted none (older than max_age_s now)
            counts["peers_not_admitted"] += 1
        else:
            counts["unknown"] += 1
    return counts, uninformative


def gate_tally(decisions: list[GateDecision], found: LookupResult | None) -> dict[str, int]:
    """Why the gate skipped the groups it did not graft, the metrics graft-train and the TRL adapter log alike:
    groups_capped; groups_no_peer (no admitted peer group at all) with groups_no_peer_<reason> from the lookup's
    miss_reasons (no_peer_reasons); groups_peer_uninformative (admitted peer groups, none informative: the gate's own
    and the store's only_uninformative prompts); groups_no_peer_tokenizer."""
    actions = [d.action for d in decisions]
    no_peer, uninformative_stored = no_peer_reasons(decisions, found)
    return {
        "groups_capped": actions.count("skip_capped"),
        "groups_no_peer": actions.count("skip_no_peer") - uninformative_stored,
        "groups_peer_uninformative": actions.count("skip_uninformative") + uninformative_stored,
        **{f"groups_no_peer_{reason}": count for reason, count in no_peer.items()},
        "groups_no_peer_tokenizer": actions.count("skip_no_peer_tokenizer"),
    }


class RefusedTokenizers:
    """One warning per tokenizer id whose peer groups the gate refused for want of the peer's tokenizer."""

    def __init__(self, usable: set[str] | None):
        self.usable = usable
        self.warned: set[str] = set()

    def warn(self, decisions: list[GateDecision], peer_candidates: dict[str, list[RolloutGroup]]) -> None:
        if self.usable is None:
            return
        refused: dict[str, set[str]] = {}  # tokenizer id -> the models that sampled in it
        for decision in decisions:
            if decision.action == "skip_no_peer_tokenizer":
                for group in peer_candidates.get(decision.prompt_id, []):
                    refused.setdefault(group.rollouts[0].tokenizer_id, set()).add(group.model_id)
        for tokenizer_id, models in sorted(refused.items()):
            if tokenizer_id in self.usable or tokenizer_id in self.warned:
                continue
            self.warned.add(tokenizer_id)
            log.warning(
                "peer groups of %s are in tokenizer %r, for which this trainer has no tokenizer: they are refused "
                "(counted as groups_no_peer_tokenizer). Map that id to the peer's tokenizer or model directory: "
                "graft.peer_tokenizers: {%s: /path/to/peer} (or opt in to graft.uniform_projection, which spreads the "
                "peer's logprobs evenly over characters)", ", ".join(sorted(models)), tokenizer_id, tokenizer_id,
            )
