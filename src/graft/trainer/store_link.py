"""The trainer's one link to the store: store health, lookups, broker posts, heartbeats and the outbox.

It asks, posts and pushes; how a step takes its peer groups is the source's (graft.trainer.peers), chosen once at
setup. Nothing here ever stops training on the store (but `get_group`, a replay's fetch by id):
- A store that is down, slow or erroring, or a response that is malformed in any way: the call fails in a background
  thread, the failure is counted and logged, further calls pause with exponential backoff (`available`), and the step
  goes on without peers. The first successful call after an outage resumes.
- Lookups run on one background worker (`submit_lookup`, `lookup_now`), so that a step's lookup hides behind its
  generation; broker posts (wants, served-ledger entries) run on the same worker, before the next lookup, so that a
  ledger entry of a step is in the store when the next step asks (the serving policy reads it).
- A broker post that could not be sent waits (bounded) and goes with the next one; one the store refuses (4xx) is
  logged, counted and dropped, never retried forever. The store takes the same entry twice as once (idempotent).
- Publishing: groups go into a bounded outbox pushed by a second worker; groups a failed push left wait for the next
  (the store down, slow or erroring: 5xx, 408, 429). A push the store refuses (another 4xx: a group id it holds under
  another prompt, 409; a row it finds invalid, 422) is split into one push per group, so that the store takes the others:
  each group it still refuses is named in the log, counted (groups_refused) and dropped, never retried. At the end
  (`flush`) what waits is pushed through the backoff until the deadline; what is left is said in one line.
- Heartbeats (lockstep co-training): a third thread tells the store, every few seconds, that this trainer lives, at
  which step, and whether it is waiting for its partners (`start_heartbeat`); `heartbeats` reads the partners'.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from graft.schemas import (
    MAX_LOOKUP_PROMPTS,
    MAX_PUSH_GROUPS,
    MAX_WANTS,
    Heartbeat,
    HeartbeatRequest,
    PeerLookupRequest,
    Problem,
    RolloutGroup,
    ServedRequest,
    Want,
    WantedRequest,
    WantRule,
)
from graft.services.store_api.http.client import StoreClient, StoreError, StoreUnavailable
from graft.trainer.config import StoreConfig

log = logging.getLogger("graft.trainer.peers")
OUTBOX_LIMIT = 4096  # groups kept for publishing while the store is down; older ones are dropped (counted)
BROKER_QUEUE_LIMIT = 256  # broker posts kept while the store is down; older ones are dropped (counted)
NAN = float("nan")


@dataclass
class LookupResult:
    groups: dict[str, list[RolloutGroup]] = field(default_factory=dict)  # prompt id -> peer groups, in serving order
    ok: bool = False  # False when the store could not be asked or failed
    wait_s: float = 0.0  # how long the step waited for it (co-training's wait included)
    # Co-training: steps in a row (this one included) whose wait ran out with no group from the co-trainer; NaN when
    # not co-training or before anything is known (the store down)
    peer_silent_steps: float = NAN
    # prompt id -> why the store had no group of it to give (graft.schemas.api.MISS_REASONS); empty from an older store
    miss_reasons: dict[str, str] = field(default_factory=dict)


@dataclass
class StoreCounters:
    """Cumulative counts since the trainer started; the loop logs per-step differences."""

    lookups: int = 0
    lookup_failures: int = 0
    lookups_skipped_backoff: int = 0
    lookups_late: int = 0  # not back when the gate needed them (prefetch: within peers.lookup_wait_s, default 0)
    groups_published: int = 0
    publish_failures: int = 0
    groups_dropped_from_outbox: int = 0  # more than OUTBOX_LIMIT groups waited while the store was down (oldest dropped)
    groups_refused: int = 0  # groups the store refused (4xx but 408, 429: named in the log, dropped, never retried)
    groups_not_publishable: int = 0  # a host's own groups that are no stored group (a reward outside [0, 1]: logged)
    cotrain_waits_skipped: int = 0  # co-training waits not started: the store was known to be down
    wants_posted: int = 0  # all-fail prompts without a peer group posted to the store's wanted prompts (store.want_misses)
    served_posted: int = 0  # grafted groups posted to the store's served ledger (store.max_times_served, serve_order)
    broker_failures: int = 0  # broker posts that failed (logged; kept and sent again with the next post)
    broker_refused: int = 0  # broker posts the store refused (4xx: logged and dropped)
    broker_dropped: int = 0  # broker posts dropped unsent: more than BROKER_QUEUE_LIMIT waited while the store was down
    heartbeat_failures: int = 0  # heartbeats that did not reach the store (lockstep)

    def since(self, previous: dict[str, int]) -> dict[str, int]:
        """The counts since `previous` (an earlier `dataclasses.asdict` of these), under their metric names store_*."""
        return {f"store_{name}": value - previous.get(name, 0) for name, value in dataclasses.asdict(self).items()}


@dataclass
class _Queued:
    """A group waiting in the outbox; `seq` names it, so that a push in flight removes what it pushed, by name."""

    seq: int
    group: RolloutGroup
    problem: Problem | None


def _unexpected(error: Exception) -> bool:
    """Not a store or network error: the traceback is logged too, it points at a bug."""
    return not isinstance(error, (StoreError, OSError))


def refused(error: Exception) -> bool:
    """Whether the store refused the request itself (a 4xx but 408 and 429, which say "later"): sending it again
    would be refused again. Anything else (the store down, a 5xx, a timeout) is worth another try."""
    return (isinstance(error, StoreError) and not isinstance(error, StoreUnavailable) and error.status_code is not None
            and 400 <= error.status_code < 500 and error.status_code not in (408, 429))


class StoreLink:
    """One trainer's calls to one store, each kind on a thread of its own, none ever fatal."""

    def __init__(self, store: StoreConfig, model_id: str):
        if not store.url:
            raise ValueError("a store link needs store.url")
        self.store, self.model_id = store, model_id
        # One client per thread: lookups, pushes and heartbeats never share a connection pool across threads.
        client_args = {"token": store.token, "timeout_s": store.timeout_s, "retries": store.retries}
        self._lookup_client = StoreClient(store.url, **client_args)
        self._publish_client = StoreClient(store.url, **client_args)
        self._beat_client: StoreClient | None = None
        self._lookup_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graft-peer-lookup")
        self._publish_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graft-peer-publish")
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self._down_until = 0.0
        self._outbox: list[_Queued] = []  # oldest first
        self._next_seq = 0
        self._in_flight: set[int] = set()  # seqs of the outbox's groups a push is sending now
        self._publishing: Future | None = None
        self._overflow_said = False  # the outbox's overflow was said (once per outage)
        self.last_error = ""  # what the last failed call said (the end's line names it)
        self._broker_queue: list[WantedRequest | ServedRequest] = []  # oldest first, sent by the lookup worker
        self._posting: Future | None = None
        self._beating: threading.Thread | None = None
        self._stop_beating = threading.Event()
        self.counters = StoreCounters()

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
            self._overflow_said = False

    def _record_failure(self, what: str, error: Exception) -> None:
        """Back off, and say so."""
        with self._lock:
            self._consecutive_failures += 1
            pause = min(self.store.backoff_initial_s * 2 ** (self._consecutive_failures - 1), self.store.backoff_max_s)
            self._down_until = time.monotonic() + pause
            self.last_error = f"{what}: {type(error).__name__}: {error}"
            log.warning("store %s: %s failed (%s: %s); training goes on without peers, next try in %.1f s",
                        self.store.url, what, type(error).__name__, error, pause, exc_info=_unexpected(error))

    def count(self, name: str, by: int = 1) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + by)

    # ---- lookups ------------------------------------------------------------------------------
    def submit_lookup(self, request: PeerLookupRequest) -> Future | None:
        """Ask for the request's peer groups in the background; None while backing off."""
        if not self.available:
            self.count("lookups_skipped_backoff")
            return None
        return self._lookup_pool.submit(self._lookup, request)

    def lookup_now(self, request: PeerLookupRequest) -> LookupResult:
        """The request's peer groups, asked now (on the lookup worker, after what is queued there) and waited for."""
        return self._lookup_pool.submit(self._lookup, request).result()

    def _lookup(self, request: PeerLookupRequest) -> LookupResult:
        self._send_broker_queue()  # a ledger entry of the last step is in the store before this lookup asks
        result = LookupResult()
        self.count("lookups")
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
            self.count("lookup_failures")
            self._record_failure("peer lookup", error)
            return LookupResult()
        self._record_success()
        result.ok = True
        return result

    def get_group(self, group_id: str) -> RolloutGroup | None:
        """The group by id, asked now (None: the store does not hold it). Store trouble raises: its one caller, a
        replay, cannot go on without the group."""
        return self._lookup_pool.submit(self._lookup_client.get_group, group_id).result()

    def collect(self, pending: Future | None, wait_s: float) -> LookupResult:
        """The lookup's result if it is back within `wait_s` seconds (0: only if already back)."""
        if pending is None:
            return LookupResult()
        try:
            return pending.result(timeout=wait_s)
        except FutureTimeout:
            self.count("lookups_late")
            return LookupResult()

    # ---- the store as a broker: wants and the served ledger -----------------------------------
    def post_broker(self, learner_step: int, wants: list[Want], served: list[str], rule: WantRule) -> None:
        """Queue the step's wants (with the learner's rule of which groups it takes: a group it would refuse clears
        none) and served-ledger entries, and send them in the background, ahead of the next lookup."""
        requests: list[WantedRequest | ServedRequest] = [
            WantedRequest(learner_model=self.model_id, policy_step=learner_step, wants=wants[begin:begin + MAX_WANTS],
                          rule=rule)
            for begin in range(0, len(wants), MAX_WANTS)]
        requests += [ServedRequest(learner_model=self.model_id, policy_step=learner_step,
                                   group_ids=served[begin:begin + MAX_WANTS]) for begin in range(0, len(served), MAX_WANTS)]
        if not requests:
            return
        with self._lock:
            self._broker_queue.extend(requests)
            overflow = len(self._broker_queue) - BROKER_QUEUE_LIMIT
            if overflow > 0:
                del self._broker_queue[:overflow]
                self.counters.broker_dropped += overflow
        if self.available:
            self._posting = self._lookup_pool.submit(self._send_broker_queue)

    def _send_broker_queue(self) -> None:
        """Send the queued broker posts, oldest first, until one fails for want of the store (it stays queued)."""
        while self.available:
            with self._lock:
                if not self._broker_queue:
                    return
                request = self._broker_queue[0]
            try:
                if isinstance(request, WantedRequest):
                    self._lookup_client.post_wanted(request)
                else:
                    self._lookup_client.record_served(request)
            except StoreError as error:
                if not refused(error):
                    self.count("broker_failures")
                    self._record_failure("posting wants and served groups", error)
                    return  # kept: it goes again with the next post or lookup
                # refused (4xx): sending it again would be refused again
                log.error("store %s refused a broker post (%s): %d %s dropped", self.store.url, error,
                          len(getattr(request, "wants", None) or request.group_ids),
                          "wants" if isinstance(request, WantedRequest) else "served-ledger entries")
                self.count("broker_refused")
            except Exception as error:  # noqa: BLE001 - as for lookups: counted, kept, never fatal
                self.count("broker_failures")
                self._record_failure("posting wants and served groups", error)
                return
            else:
                self._record_success()
                if isinstance(request, WantedRequest):
                    self.count("wants_posted", len(request.wants))
                else:
                    self.count("served_posted", len(request.group_ids))
            with self._lock:
                self._broker_queue.pop(0)

    @property
    def broker_queued(self) -> int:
        with self._lock:
            return len(self._broker_queue)

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

    def push_queued(self) -> None:
        """Push what a failed push left queued, now, unless a push is on its way (a co-trainer may be waiting for it)."""
        if self.outbox_size and self.available and (self._publishing is None or self._publishing.done()):
            self._publishing = self._publish_pool.submit(self._flush)

    def _trim_outbox(self) -> None:
        """Drop the oldest groups beyond OUTBOX_LIMIT among those waiting (a push in flight keeps its own: they are
        counted published or, if it fails, wait again), saying so once per outage; with the lock held."""
        waiting = [entry.seq for entry in self._outbox if entry.seq not in self._in_flight]
        overflow = len(waiting) - OUTBOX_LIMIT
        if overflow > 0:
            dropped = set(waiting[:overflow])
            self._outbox = [entry for entry in self._outbox if entry.seq not in dropped]
            self.counters.groups_dropped_from_outbox += overflow
            if not self._overflow_said:
                self._overflow_said = True
                log.warning("store %s: more than %d sampled groups wait to be published while it cannot be reached: "
                            "the oldest are dropped, never pushed (metric store_groups_dropped_from_outbox)",
                            self.store.url, OUTBOX_LIMIT)

    def _flush(self) -> None:
        while True:
            with self._lock:
                batch = self._outbox[:MAX_PUSH_GROUPS]
                self._in_flight = {entry.seq for entry in batch}
            if not batch:
                return
            error = self._push(batch)
            if error is not None and refused(error):
                # One bad group refuses the whole push: the store then takes the others one by one
                error = self._push_each(batch) if len(batch) > 1 else self._drop_refused(batch[0], error)
            if error is not None:
                with self._lock:
                    self.counters.publish_failures += 1
                    self._in_flight = set()
                    self._trim_outbox()
                self._record_failure("publishing groups", error)
                return
            self._record_success()

    def _push(self, entries: list[_Queued]) -> Exception | None:
        """Push `entries` in one request: None when the store took them (they leave the outbox, counted published),
        else what went wrong (they stay)."""
        problems = list({e.problem.prompt_id: e.problem for e in entries if e.problem is not None}.values())
        try:
            self._publish_client.push_groups([entry.group for entry in entries], problems=problems or None)
        except Exception as error:  # noqa: BLE001 - as for lookups: counted, retried later, never fatal
            return error
        self._settle(entries, "groups_published")
        return None

    def _push_each(self, entries: list[_Queued]) -> Exception | None:
        """A push the store refused, one group at a time: the store takes the others, and each group it refuses is
        dropped (`_drop_refused`). Returns the first error that is no refusal (the rest then wait), else None."""
        for entry in entries:
            error = self._push([entry])
            if error is not None:
                error = self._drop_refused(entry, error) if refused(error) else error
            if error is not None:
                return error
        return None

    def _drop_refused(self, entry: _Queued, error: Exception) -> None:
        """A group the store refused: named in the log, counted, dropped (pushing it again would be refused again)."""
        group = entry.group
        log.error("store %s refused group %s (model %s, prompt %s, policy step %d): %s; the group is dropped, not sent "
                  "again (metric store_groups_refused)", self.store.url, group.group_id, group.model_id, group.prompt_id,
                  group.policy_step, error)
        self._settle([entry], "groups_refused")

    def _settle(self, entries: list[_Queued], counter: str) -> None:
        """`entries` leave the outbox, by name (publish() may have trimmed or added groups meanwhile), counted."""
        seqs = {entry.seq for entry in entries}
        with self._lock:
            self._outbox = [entry for entry in self._outbox if entry.seq not in seqs]
            self._in_flight -= seqs
            setattr(self.counters, counter, getattr(self.counters, counter) + len(entries))

    def flush(self, timeout_s: float) -> bool:
        """Deliver what waits (groups and broker posts) within `timeout_s`: the run's last chance, so a store backed off
        from is tried again when its pause ends, until the deadline. True when nothing is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            for pending in (self._publishing, self._posting):
                if pending is not None:
                    try:
                        pending.result(timeout=max(0.0, deadline - time.monotonic()))
                    except FutureTimeout:
                        return False
            if not self.outbox_size and not self.broker_queued:
                return True
            pause = max(0.0, self._down_until - time.monotonic())
            if time.monotonic() + pause >= deadline:
                return False
            time.sleep(pause)
            if self.outbox_size:
                self._publishing = self._publish_pool.submit(self._flush)
            if self.broker_queued:
                self._posting = self._lookup_pool.submit(self._send_broker_queue)

    @property
    def outbox_size(self) -> int:
        with self._lock:
            return len(self._outbox)

    # ---- heartbeats ---------------------------------------------------------------------------
    def start_heartbeat(self, every_s: float, state: Callable[[], tuple[int, bool]]) -> None:
        """Tell the store every `every_s` seconds that this trainer lives: `state()` gives (policy step, waiting for
        partners). From a thread of its own, so that a long evaluation or checkpoint keeps beating."""
        self._beat_client = StoreClient(self.store.url, token=self.store.token, timeout_s=min(self.store.timeout_s, every_s * 2),
                                        retries=0)

        def beat() -> None:
            while True:
                step, waiting = state()
                try:
                    self._beat_client.beat(HeartbeatRequest(model_id=self.model_id, step=step, waiting=waiting))
                except Exception as error:  # noqa: BLE001 - a missed beat is counted; the partner's timeout is long
                    self.count("heartbeat_failures")
                    log.debug("heartbeat to %s failed: %s", self.store.url, error)
                if self._stop_beating.wait(every_s):
                    return

        self._beating = threading.Thread(target=beat, name="graft-heartbeat", daemon=True)
        self._beating.start()

    def heartbeats(self, models: list[str]) -> dict[str, Heartbeat] | None:
        """The store's last heartbeat of each of `models` that has beaten (on the lookup worker); None when the store
        could not be asked."""
        def read() -> dict[str, Heartbeat] | None:
            try:
                return self._lookup_client.heartbeats(models)
            except Exception as error:  # noqa: BLE001 - store trouble: no word of the partners this time
                self._record_failure("reading heartbeats", error)
                return None

        return self._lookup_pool.submit(read).result()

    def close(self) -> None:
        self._stop_beating.set()
        if self._beating is not None:
            self._beating.join(timeout=self.store.timeout_s)
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._publish_pool.shutdown(wait=False, cancel_futures=True)
        for client in (self._lookup_client, self._publish_client, self._beat_client):
            if client is not None:
                client.close()
