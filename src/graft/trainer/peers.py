"""How peer groups arrive: one source per run, named by one setting (peers.source) and built once at setup
(`make_source`), each over the run's link to the store (graft.trainer.store_link, which only talks to the store).

Every source gives the step's lookup rule (`request`: its `accepts` is the rule of which peer group may be grafted; the
store's lookup, the gate and the co-training waits apply it alike) and the peer groups the gate chooses from
(`candidates`, from the step's lookup(s) and the learner's own rewards), publishes the run's own groups when it should
(`publish`), and acts on the gate's decisions (`after_gate`: the broker's wants and served ledger, a replay's
comparison). graft-train's loop and the framework trainers that host GRAFT (TRL, verl) call the same sources.
- `PeerSource` (prefetch): the step's lookup runs in the background while the learner samples; the gate takes what is
  back within peers.lookup_wait_s (one deadline per step, however many lookups a host's step spans); a step whose
  lookup was later trains as GRPO, counted, and LATE_WARN_STEPS such steps in a row are warned about. Publishes when
  peers.publish says so.
- `Cotrain`: publishes every sampled group; waits up to peers.wait_s for the co-trainer's groups of the step's all-fail
  prompts that have none the gate would graft yet (the co-trainer may still be sampling them); does not wait while
  the store is known to be down, and counts (metric `cotrain_peer_silent_steps`) and warns about steps whose wait ran
  out with nothing from it.
- `Lockstep`: publishes every sampled group; every step waits for each partner's group of that very step for each of
  its prompts, as long as the partner lives: its heartbeats in the store (sent from a thread of its own, through an
  evaluation or a checkpoint) or its new groups are signs of life; a partner without one for peers.partner_timeout_s,
  or one waiting for this trainer as it waits for the partner, is gone (PartnerGone, naming it). What a step grafts
  does not depend on timing.
- `Replay`: the recorded run's groups of the step, by id; stops at the first step whose own rewards or grafts differ
  from the record (graft.trainer.replay.RecordedRun).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from graft.schemas import MAX_LOOKUP_PROMPTS, Heartbeat, PeerLookupRequest, Problem, RolloutGroup, Want, WantRule
from graft.trainer.config import CotrainPeers, GraftOptions, LockstepPeers, StoreConfig, TrainConfig
from graft.trainer.gate import GRAFT_ACTIONS, GateDecision, choose_peer_group, classify_group
from graft.trainer.replay import RecordedRun
from graft.trainer.store_link import NAN, LookupResult, StoreLink

log = logging.getLogger(__name__)
PEER_SILENT_WARN_STEPS = 5  # co-training steps in a row without a group from the co-trainer before a warning
LATE_WARN_STEPS = 3  # steps in a row whose lookup was not back within the lookup wait before a warning
Pending = Future | list[Future | None] | None  # a step's background lookup(s): a host may start several for one step
LearnerRewards = list[tuple[str, list[float | None]]]  # (prompt id, the learner's rewards of its group), per group


class PartnerGone(RuntimeError):
    """Lockstep co-training: a partner that owes groups of the step showed no sign of life for peers.partner_timeout_s."""


class PeerSource:
    """prefetch: the step's lookup in the background, the gate takes what is back (after peers.lookup_wait_s)."""

    co_trains = False  # whether a co-trainer's groups are waited for (and its silence counted)

    def __init__(self, link: StoreLink, graft: GraftOptions, store: StoreConfig, learner_model: str,
                 publishes: bool = False, lookup_wait_s: float = 0.0):
        self.link, self.graft, self.store, self.learner_model = link, graft, store, learner_model
        self.publishes, self.lookup_wait_s = publishes, lookup_wait_s
        self.late_steps = 0  # steps in a row whose lookup was not back within the wait

    @property
    def counters(self):
        return self.link.counters

    # ---- before sampling ------------------------------------------------------------------------
    def request(self, prompt_ids: list[str], learner_step: int) -> PeerLookupRequest | None:
        """The step's lookup for `prompt_ids`; its `accepts` is the rule the gate applies to what comes back.
        None without prompts (a data-parallel rank whose block of the step is empty): nothing to ask.

        A step may hold more prompts than one call takes: the request is validated on its first
        MAX_LOOKUP_PROMPTS and sent in chunks (StoreLink)."""
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
        """Ask for the request's peer groups in the background (while the learner samples); None while the store is
        backed off from (or with no request)."""
        return self.link.submit_lookup(request) if request is not None else None

    def collect(self, pending: Future | None, wait_s: float) -> LookupResult:
        """The background lookup's result if it is back within `wait_s` seconds (0: only if already back)."""
        return self.link.collect(pending, wait_s)

    def gather(self, pending: Pending, wait_s: float) -> LookupResult:
        """What the step's lookup(s) brought within `wait_s` seconds, one deadline for them all, by prompt; the step is
        counted late (`note_late`) when one was still out. ok: every lookup was asked and answered."""
        deadline = time.monotonic() + wait_s
        found, late = LookupResult(ok=True), False
        for future in pending if isinstance(pending, list) else [pending]:
            before = self.counters.lookups_late
            result = self.collect(future, max(0.0, deadline - time.monotonic()))
            late |= self.counters.lookups_late > before
            found.ok &= result.ok
            for prompt_id, groups in result.groups.items():
                found.groups.setdefault(prompt_id, []).extend(groups)
            found.miss_reasons.update(result.miss_reasons)
        self.note_late(late)
        return found

    def note_late(self, late: bool) -> None:
        """Count the steps in a row whose lookup was not back within the wait, and say so: they train as GRPO."""
        self.late_steps = self.late_steps + 1 if late else 0
        if self.late_steps == LATE_WARN_STEPS or (late and self.late_steps % (10 * LATE_WARN_STEPS) == 0):
            log.warning("the store's answer came too late to graft from in %d steps in a row (each waited up to %g s "
                        "after generation: peers.lookup_wait_s, TRL's graft_lookup_wait_s, verl's graft.lookup_wait_s; "
                        "metric store_lookups_late): those steps' all-fail groups train as GRPO. Is the store %s slow or "
                        "overloaded? Raise the wait, or serve it closer", self.late_steps, self.lookup_wait_s,
                        self.store.url)

    # ---- after sampling -------------------------------------------------------------------------
    def publish(self, groups: list[RolloutGroup], problems: list[Problem | None]) -> None:
        """The run's own groups to the store, in the background (when this source publishes)."""
        if self.publishes:
            self.link.publish(groups, problems)

    def candidates(self, pending: Pending, request: PeerLookupRequest | None, learner_rewards: LearnerRewards,
                   usable_tokenizers: set[str] | None, policy_step: int) -> LookupResult:
        """The peer groups the step's gate chooses from, by prompt, in serving order. No request: nothing asked."""
        if request is None:
            return LookupResult(ok=True)
        started = time.monotonic()
        found = self.gather(pending, self.lookup_wait_s)
        found.wait_s = time.monotonic() - started
        return found

    # ---- after the gate -------------------------------------------------------------------------
    def want_rule(self) -> WantRule:
        """Which groups this learner takes, posted with its wants: only such a group clears them."""
        return WantRule(peer_models=self.graft.peer_models, max_policy_lag=self.graft.max_peer_policy_lag,
                        require_behaviour_logprobs=self.graft.require_behaviour_logprobs,
                        informative_only=not self.graft.union_all_success, max_times_served=self.store.max_times_served)

    def after_gate(self, policy_step: int, decisions: list[GateDecision], found: LookupResult | None,
                   problem_of: dict[str, Problem], learner_rewards: LearnerRewards) -> None:
        """Post the step's all-fail prompts that got no peer group to graft to the store's wanted prompts
        (store.want_misses), and the peer groups grafted to its served ledger (when the serving policy reads it), in the
        background, ahead of the next lookup; a failure is counted, logged and sent again later, never fatal. Nothing
        when the lookup was not answered (the store down: its reasons are unknown). A prompt whose gold answer the
        scorer could not read (every reward None) is not wanted: no generator's group of it can score either."""
        if found is None or not found.ok:
            return
        wants = []
        if self.store.want_misses:
            unscorable = {prompt for prompt, rewards in learner_rewards if all(r is None for r in rewards)}
            for decision in decisions:
                if decision.action not in ("skip_no_peer", "skip_uninformative") or decision.prompt_id in unscorable:
                    continue
                reason = found.miss_reasons.get(decision.prompt_id) or (
                    "only_uninformative" if decision.action == "skip_uninformative" else "peers_not_admitted")
                # a host that does not know a prompt's problem sends none: the store takes it for a prompt it knows
                wants.append(Want(prompt_id=decision.prompt_id, reason=reason, problem=problem_of.get(decision.prompt_id)))
        served = [d.peer_group.group_id for d in decisions if d.grafts] if self.store.records_served else []
        if wants or served:
            self.link.post_broker(policy_step, wants, served, self.want_rule())

    # ---- the end --------------------------------------------------------------------------------
    def finish(self, timeout_s: float) -> None:
        """Deliver what waits (published groups, broker posts), at most `timeout_s`; say what could not be."""
        if not self.link.flush(timeout_s):
            log.warning("%d sampled groups and %d broker posts could not be delivered to the store %s within %g s of the "
                        "end (its last error: %s): they are dropped", self.link.outbox_size, self.link.broker_queued,
                        self.store.url, timeout_s, self.link.last_error or "none: still being sent")

    def close(self) -> None:
        self.link.close()


class _CoTraining(PeerSource):
    """A source that waits for co-trainers' groups (cotrain, lockstep): it publishes every group it samples, polls the
    store every peers.poll_s while it waits, and stops waiting when the trainer is asked to stop."""

    co_trains = True

    def __init__(self, link: StoreLink, graft: GraftOptions, store: StoreConfig, learner_model: str,
                 settings: CotrainPeers | LockstepPeers, stopping: Callable[[], bool] = lambda: False):
        super().__init__(link, graft, store, learner_model, publishes=True)
        self.poll_s = settings.poll_s
        self.stopping = stopping  # True once the trainer is asked to stop (SIGTERM): the wait ends early

    def note_late(self, late: bool) -> None:
        """Nothing: a late lookup is counted (store_lookups_late), and what a co-trainer did not deliver is waited for,
        counted and said as its silence (`Cotrain.note_wait`)."""


class Cotrain(_CoTraining):
    """cotrain: publish every group, wait a bounded time for the co-trainer's groups of the step's all-fail prompts."""

    def __init__(self, link: StoreLink, graft: GraftOptions, store: StoreConfig, learner_model: str,
                 settings: CotrainPeers, stopping: Callable[[], bool] = lambda: False):
        super().__init__(link, graft, store, learner_model, settings, stopping)
        self.wait_s = settings.wait_s
        self.silent_steps = 0  # steps in a row whose wait ran out without a group from the co-trainer

    def candidates(self, pending: Pending, request: PeerLookupRequest | None, learner_rewards: LearnerRewards,
                   usable_tokenizers: set[str] | None, policy_step: int) -> LookupResult:
        """The background lookup's answer (waited for up to peers.wait_s), and what arrives within peers.wait_s for the
        all-fail prompts that have no group the gate would graft yet."""
        if request is None:
            return LookupResult(ok=True)
        started = time.monotonic()
        lookup = self.gather(pending, self.wait_s)
        all_fail = [prompt for prompt, rewards in learner_rewards if classify_group(rewards) == "all_fail"]
        missing = [p for p in all_fail
                   if choose_peer_group(lookup.groups.get(p, []), request, usable_tokenizers,
                                        trust_unverified_mu=self.graft.trust_unverified_mu)[1] not in GRAFT_ACTIONS]
        waited = None
        if missing:
            waited = self.wait_for_peers(request.model_copy(update={"prompt_ids": missing}), started + self.wait_s)
            lookup.groups.update(waited.groups)
            lookup.miss_reasons.update(waited.miss_reasons)
        lookup.peer_silent_steps = self.note_wait(waited, delivered=bool(all_fail) and not missing)
        lookup.wait_s = time.monotonic() - started
        return lookup

    def wait_for_peers(self, request: PeerLookupRequest, deadline: float) -> LookupResult:
        """Look up the request's prompts repeatedly until each has a peer group (informative or not: the peer has
        sampled it), `deadline` passes, the store fails (it backs off: waiting longer would bring nothing) or the
        trainer is asked to stop. Returns what was found (ok: some lookup answered); never raises on store trouble."""
        any_group = request.model_copy(update={
            "informative_only": False, "min_successes": 0, "groups_per_prompt": max(request.groups_per_prompt, 4)})
        found = LookupResult()
        if not self.link.available:  # known to be down (backing off): waiting cannot bring the co-trainer's groups
            self.link.count("cotrain_waits_skipped")
            return found
        missing = list(dict.fromkeys(request.prompt_ids))
        while missing and time.monotonic() < deadline and self.link.available and not self.stopping():
            pending = self.link.submit_lookup(any_group.model_copy(update={"prompt_ids": missing}))
            result = self.collect(pending, max(0.0, deadline - time.monotonic()))
            found.ok |= result.ok
            found.groups.update(result.groups)
            found.miss_reasons.update(result.miss_reasons)
            missing = [p for p in missing if p not in found.groups]
            if missing and self.link.available:
                # The co-trainer may be waiting for our groups as we wait for its: groups a failed push left queued go
                # again now, not after this wait.
                self.link.push_queued()
                time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        return found

    def note_wait(self, waited: LookupResult | None, delivered: bool) -> float:
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
                "for %d steps (each waited up to peers.wait_s = %g s) although the store %s answers: is it running, "
                "and pushing to this store? Those prompts train as GRPO meanwhile (metric cotrain_peer_silent_steps)",
                self.graft.peer_models or "any", self.silent_steps, self.wait_s, self.store.url)
        return float(self.silent_steps)


class Lockstep(_CoTraining):
    """lockstep: every step takes exactly the partners' groups of that step, waiting for them as long as they live."""

    def __init__(self, link: StoreLink, graft: GraftOptions, store: StoreConfig, learner_model: str,
                 settings: LockstepPeers, stopping: Callable[[], bool] = lambda: False):
        super().__init__(link, graft, store, learner_model, settings, stopping)
        self.partners = list(graft.peer_models or [])
        self.timeout_s = settings.partner_timeout_s
        self.step, self.waiting = 0, False  # what the heartbeats say
        link.start_heartbeat(settings.heartbeat_s, lambda: (self.step, self.waiting))

    def request(self, prompt_ids: list[str], learner_step: int) -> PeerLookupRequest | None:
        self.step = learner_step
        return super().request(prompt_ids, learner_step)

    def start_lookup(self, request: PeerLookupRequest | None) -> Future | None:
        return None  # a lookup before sampling would see the step before: the groups of the step come after it

    def candidates(self, pending: Pending, request: PeerLookupRequest | None, learner_rewards: LearnerRewards,
                   usable_tokenizers: set[str] | None, policy_step: int) -> LookupResult:
        if request is None:
            return LookupResult(ok=True)
        started = time.monotonic()
        self.waiting = True
        try:
            found = self.wait_for_step(request, policy_step)
        finally:
            self.waiting = False
        found.wait_s = time.monotonic() - started
        return found

    def wait_for_step(self, request: PeerLookupRequest, policy_step: int) -> LookupResult:
        """Look up the request's prompts until every partner has published its group of `policy_step` for each
        (informative or not), through store trouble, as long as each partner that still owes groups shows signs of life
        (`_alive`); PartnerGone otherwise. Returns exactly the groups of that step, by prompt, in group id order (the
        gate's choice among them depends on nothing else)."""
        of_step = request.model_copy(update={
            "informative_only": False, "min_successes": 0, "min_policy_step": policy_step, "groups_per_prompt": 16})
        found = LookupResult(ok=True, peer_silent_steps=0.0)
        owed = {partner: list(dict.fromkeys(request.prompt_ids)) for partner in self.partners}  # partner -> prompts
        signs: dict[str, tuple | None] = dict.fromkeys(self.partners)
        alive_at = dict.fromkeys(self.partners, time.monotonic())  # by this trainer's clock, never another's
        missing = list(dict.fromkeys(request.prompt_ids))
        while missing:
            if self.stopping():
                raise PartnerGone(f"lockstep co-training: asked to stop while waiting for the groups of step {policy_step} "
                                  f"of {', '.join(self.partners)}; the step is not trained (its groups would depend on "
                                  "when the signal came): continue with --resume")
            answer = self.link.lookup_now(of_step.model_copy(update={"prompt_ids": missing}))
            now = time.monotonic()
            for prompt_id in list(missing):
                groups = sorted((g for g in answer.groups.get(prompt_id, [])
                                 if g.policy_step == policy_step and g.model_id in self.partners), key=lambda g: g.group_id)
                for partner in {g.model_id for g in groups}:
                    if prompt_id in owed[partner]:
                        owed[partner].remove(prompt_id)
                        alive_at[partner] = now  # a new group of it: it lives
                if {g.model_id for g in groups} >= set(self.partners):
                    found.groups[prompt_id] = groups
                    missing.remove(prompt_id)
            if not missing:
                break
            beats = self.link.heartbeats([p for p in self.partners if owed[p]])
            for partner in (p for p in self.partners if owed[p]):
                beat = (beats or {}).get(partner)
                sign = None if beat is None else (beat.beats, beat.step, beat.waiting)
                if sign is not None and sign != signs[partner] and not (beat.waiting and beat.step >= policy_step):
                    alive_at[partner] = now
                signs[partner] = sign
                if now - alive_at[partner] > self.timeout_s:
                    raise PartnerGone(self._gone(partner, beat, beats is None, policy_step, owed[partner],
                                                 len(request.prompt_ids)))
            # Our groups of the step may still be queued (a failed push): the partner waits for them as we wait for its.
            self.link.push_queued()
            time.sleep(self.poll_s)
        return found

    def _gone(self, partner: str, beat: Heartbeat | None, store_failed: bool, step: int, owed: list[str],
              prompts: int) -> str:
        if beat is not None and beat.waiting and beat.step >= step:
            why = (f"it waits for this trainer's groups of step {beat.step} while this trainer waits for its groups of "
                   f"step {step}: the two draw other prompts (same seed, data and rollout.prompts_per_step?) or the store "
                   "refuses their groups")
        else:
            last = (f"its last heartbeat: step {beat.step}, {beat.age_s:.0f} s ago by the store's clock" if beat is not None
                    else "no heartbeat of it in the store" + (" (whose heartbeats could not be read: see the warning "
                                                              "above)" if store_failed else ""))
            why = f"it showed no sign of life ({last}, no new group)"
        return (f"lockstep co-training: {partner} is gone: for peers.partner_timeout_s = {self.timeout_s:g} s {why}. It owes "
                f"groups of step {step} for {len(owed)} of this step's {prompts} prompts (e.g. {', '.join(owed[:3])}; store "
                f"{self.store.url}). The run stops rather than train the step without them; once the partner is back, "
                "continue both with --resume")


class Replay(PeerSource):
    """replay: the recorded run's peer groups, step by step, from the store by id, and the record checked as it goes
    (graft.trainer.replay.RecordedRun)."""

    def __init__(self, link: StoreLink, cfg: TrainConfig):
        super().__init__(link, cfg.graft, cfg.store, link.model_id)
        self.recorded = RecordedRun(cfg)  # refuses another config, a missing or older record: before the model loads
        self.co_trains = self.recorded.config.co_trains  # the recorded run's metrics lines say what its co-trainer did

    def start_lookup(self, request: PeerLookupRequest | None) -> Future | None:
        return None  # no lookup: the groups come by id

    def candidates(self, pending: Pending, request: PeerLookupRequest | None, learner_rewards: LearnerRewards,
                   usable_tokenizers: set[str] | None, policy_step: int) -> LookupResult:
        """The recorded lookup of the step (recorded under the metrics' step, policy step + 1), checked by hash."""
        return self.recorded.lookup(policy_step + 1, self.link.get_group, self.store.url)

    def after_gate(self, policy_step: int, decisions: list[GateDecision], found: LookupResult | None,
                   problem_of: dict[str, Problem], learner_rewards: LearnerRewards) -> None:
        """Stop at the first difference from the record, before the step trains; nothing is posted."""
        self.recorded.compare(policy_step + 1, learner_rewards, [d.peer_group.group_id for d in decisions if d.grafts])


def make_source(cfg: TrainConfig, learner_model: str, stopping: Callable[[], bool] = lambda: False,
                runs: tuple[str, ...] = ("prefetch", "cotrain", "lockstep", "replay")) -> PeerSource:
    """The run's source of peer groups, as peers.source names it, over a link to cfg.store; `runs`: the sources the
    calling trainer runs (a framework's adapter runs fewer: the others are refused, naming them)."""
    settings = cfg.peers
    if settings.source not in runs:
        raise ValueError(f"peers.source {settings.source}: this trainer runs {', '.join(runs)} only")
    link = StoreLink(cfg.store, learner_model)
    if settings.source == "cotrain":
        return Cotrain(link, cfg.graft, cfg.store, learner_model, settings, stopping)
    if settings.source == "lockstep":
        return Lockstep(link, cfg.graft, cfg.store, learner_model, settings, stopping)
    if settings.source == "replay":
        return Replay(link, cfg)
    return PeerSource(link, cfg.graft, cfg.store, learner_model, publishes=settings.publish,
                      lookup_wait_s=settings.lookup_wait_s)

