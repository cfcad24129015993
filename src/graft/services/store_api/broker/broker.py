"""The store as a two-way broker: a learner's misses become the generators' work (wanted prompts), and a served
ledger lets a lookup limit and order what it serves (`PeerLookupRequest.max_times_served`, `order`).

One module of ~470 lines: wants, rules, leases and the ledger are one state under one lock, changed by journal records
alone (`_apply`); split apart, each part would reach into the others' maps. What stands apart is apart: the listing
order (backlog.py), the journal file (journal.py), the heartbeats (heartbeats.py).

`Broker` owns both, in memory, and keeps them in a `Journal` (journal.py: appended and fsynced before a call
returns, rewritten atomically to the current state when it has grown; a restart reads it back):
- a want is (prompt, learner): the reason of the learner's last miss, first and last time and step, how many
  misses. At most `max_wanted` are open; past that the least recently missed goes (counted as evicted). The
  problem's text and answer come with the first want of a prompt, so that a generator can sample it. A learner posts
  its rule of which groups it takes with its wants (`WantRule`: peer models, lag, behaviour logprobs, outcome, cap).
- a want is cleared by a group of the prompt that the wanting learner's rule takes (at its newest reported step)
  and that this store indexed after the want (`clear_landed`, called by the ingest loop after each poll; it reads the
  index through its queries, `index.queries`). "After" is the index's own order (its seq), never a comparison of
  the generator's clock with the store's.
- a generator takes wanted prompts by lease (`lease`): each is its alone until a group of its model for the prompt is
  indexed, or for the lease's time by the store's clock; a want whose rule leaves the generator's model out, or the
  generator's own model's wants as a learner, are not handed to it. Leases live in memory (a restarted store has none:
  at worst one prompt is sampled twice).
- the ledger counts, per learner, how often each group was served (POST /v1/served: what the learner grafted), with
  the step and time of the last entry. An entry for a group the store never had is refused (`UnknownGroups`). A
  learner's entries of a step posted again (a retry after a lost answer) count once, as does a miss posted again.
- listings (`wanted`) and leases walk the backlog in order from a cursor (backlog.py): a page costs its size.

Metrics (`stats`): backlog, seconds from a want to the group that cleared it (by this store's clock), and the share
of wants cleared within N of the learner's steps (its steps as it reports them with wants and ledger entries).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from graft.schemas import (
    BrokerStats,
    LeaseRequest,
    PeerLookupRequest,
    ServedRequest,
    ServedResponse,
    WantedList,
    WantedPrompt,
    WantedRequest,
    WantedResponse,
    WantRule,
)
from graft.services.store_api.broker.backlog import Backlog, WantedOrder, decode_cursor, encode_cursor
from graft.services.store_api.broker.heartbeats import Heartbeats
from graft.services.store_api.broker.journal import Journal
from graft.services.store_api.local import GroupRef, now_us, us_to_datetime
from graft.services.store_api.settings import StoreSettings

log = logging.getLogger("graft.store")
HISTORY = 10_000  # cleared wants kept for the metrics (the most recent)


class GroupSource(Protocol):
    """What the broker reads of a store's index: its queries (`index.queries`, IndexQueries)."""

    def prompt_refs(self, prompt_id: str) -> list[GroupRef]: ...
    def select_group(self, group_id: str) -> list[GroupRef]: ...
    def groups_after(self, seq: int) -> tuple[list[tuple[int, str, str]], int]: ...
    def newest_seq(self) -> int: ...


class JournalStore(Protocol):
    """Where a broker keeps its records: a store root's file (journal.py) or a lake's table (lake/journal.py)."""

    path: object  # named in messages
    writer: str  # whose records carry this index's seqs (another writer's are another index's)

    def read(self) -> list[dict]: ...
    def read_new(self) -> list[dict] | None: ...  # other writers' records since the last read; None: read() again
    def append(self, records: list[dict]) -> None: ...
    def rewrite(self, records: list[dict]) -> None: ...
    def close(self) -> None: ...


class UnknownPrompts(LookupError):
    """Wants for prompts the store has no problem of (the want must bring it)."""


class UnknownGroups(LookupError):
    """Ledger entries for groups this store does not hold."""


@dataclass
class OpenWant:
    prompt_id: str
    learner: str
    reason: str
    first_us: int
    last_us: int
    first_step: int
    last_step: int
    misses: int = 1
    seq: int = 0  # groups this store indexes from this seq on came after the want: only they can clear it
    seen_us: int = 0  # when this store learned of it, by its own clock (the metric's start)


@dataclass(frozen=True)
class Cleared:
    first_us: int
    cleared_us: int
    steps: int  # the learner's steps from the want to the clearing (as far as it reported them)


@dataclass
class Lease:
    generator: str
    model: str
    until: float  # time.monotonic() of this store
    seq: int  # a group of `model` indexed from this seq on ends the lease


class Broker:
    """Wanted prompts and the served ledger of one store; thread-safe."""

    def __init__(self, journal: JournalStore, max_wanted: int, within_steps: int):
        self.journal = journal
        self.max_wanted = max_wanted
        self.within_steps = within_steps
        self.heartbeats = Heartbeats()
        self._lock = threading.Lock()
        self._groups: GroupSource | None = None
        self._reset()
        self._seen_seq = 0

    def _reset(self) -> None:
        """An empty state (before the journal is read)."""
        self._wants: OrderedDict[tuple[str, str], OpenWant] = OrderedDict()  # least recently missed first
        self._by_prompt: dict[str, set[str]] = {}  # prompt -> learners with an open want
        self._backlog = Backlog()  # the prompts in listing order, per learner
        self._problems: dict[str, tuple[str, str, str]] = {}  # prompt -> (dataset, problem, answer)
        self._rules: dict[str, WantRule] = {}  # learner -> the rule it posted last
        self._learner_step: dict[str, int] = {}
        self._served: dict[str, dict[str, int]] = {}  # learner -> group -> times
        self._served_last: dict[tuple[str, str], tuple[int, int]] = {}  # (learner, group) -> (step, us) of the last
        self._history: deque[Cleared] = deque(maxlen=HISTORY)
        self._totals = {"recorded": 0, "cleared": 0, "evicted": 0}
        self._leases: dict[str, Lease] = {}
        self._journal_records = 0

    # ------------------------------------------------------------------ lifecycle

    def open(self, groups: GroupSource) -> Broker:
        """Read the journal back, clear what groups landed while the store was down, compact the journal."""
        with self._lock:
            self._groups = groups
            self._read_whole()
            self._seen_seq = groups.newest_seq() - 1
            cleared = [self._clear_record(want, ref) for prompt in list(self._by_prompt)
                       for want, ref in self._clearing(prompt, groups.prompt_refs(prompt))]
            self._commit(cleared)
        log.info("broker: %d open wants over %d prompts, %d ledger entries", len(self._wants), len(self._by_prompt),
                 sum(map(sum, (d.values() for d in self._served.values()))))
        return self

    def close(self) -> None:
        self.journal.close()

    def _newest_seq(self) -> int:
        return self._groups.newest_seq() if self._groups is not None else 0

    # ------------------------------------------------------------------ wants

    def want(self, req: WantedRequest) -> WantedResponse:
        """Record a learner's misses (and its rule); UnknownPrompts (nothing recorded) when a prompt is new to the store
        and its want brings no problem."""
        now = now_us()
        with self._lock:
            unknown = [w.prompt_id for w in req.wants if w.problem is None and w.prompt_id not in self._problems]
            if unknown:
                raise UnknownPrompts(
                    f"{len(unknown)} wanted prompt id(s) unknown to this store (e.g. {', '.join(unknown[:3])}): send "
                    "each new prompt's problem (dataset, problem, answer) with its first want, so that a generator "
                    "can sample it")
            records: list[dict] = []
            if req.rule is not None and self._rules.get(req.learner_model) != req.rule:
                records.append({"k": "rule", "learner": req.learner_model,
                                "rule": req.rule.model_dump(exclude_defaults=True)})
            seq = self._newest_seq()
            for w in req.wants:
                record = {"k": "want", "learner": req.learner_model, "prompt": w.prompt_id, "reason": w.reason,
                          "step": req.policy_step, "at": now, "seq": seq, "by": self.journal.writer}
                if w.problem is not None:  # kept with each want that brings it: a lake's other replicas may need it
                    record |= {"dataset": w.problem.dataset, "problem": w.problem.problem, "answer": w.problem.answer}
                records.append(record)
            records.append({"k": "step", "learner": req.learner_model, "step": req.policy_step})
            self._commit(records)
            overflow = len(self._wants) - self.max_wanted
            if overflow > 0:
                self._commit([{"k": "evict", "learner": learner, "prompt": prompt, "at": now}
                              for prompt, learner in list(self._wants)[:overflow]])
            return WantedResponse(recorded=len(req.wants), backlog=len(self._by_prompt))

    def _serving(self, model: str | None) -> list[str]:
        """The learners whose wants a generator of `model` can serve (None: every learner)."""
        return [learner for learner in self._backlog.learners() if model is None or (
            learner != model and (learner not in self._rules or self._rules[learner].admits_model(learner, model)))]

    def _listed(self, prompt: str, learners: list[str]) -> WantedPrompt:
        wants = [self._wants[(prompt, learner)] for learner in sorted(self._by_prompt[prompt]) if learner in learners]
        dataset, problem, answer = self._problems[prompt]
        return WantedPrompt(
            prompt_id=prompt, dataset=dataset, problem=problem, answer=answer, learners=[w.learner for w in wants],
            reasons=[w.reason for w in wants], first_wanted_at=us_to_datetime(min(w.first_us for w in wants)),
            last_wanted_at=us_to_datetime(max(w.last_us for w in wants)), misses=sum(w.misses for w in wants))

    def wanted(self, model: str | None, order: WantedOrder, limit: int, cursor: str | None = None) -> WantedList:
        """A page of the prompts a generator of `model` can serve (wanted by learners other than `model` whose rules
        take its groups; None: all), oldest want first or most wanted (most learners, then most misses) first, from
        `cursor` on (BadCursor for one this store did not give)."""
        after = decode_cursor(order, cursor) if cursor else None
        with self._lock:
            learners = self._serving(model)
            prompts, last = [], None
            for key, prompt in self._backlog.walk(order, learners, after):
                prompts.append(self._listed(prompt, learners))
                last = key
                if len(prompts) == limit:
                    break
            return WantedList(prompts=prompts, backlog=len(self._by_prompt),
                              next_cursor=encode_cursor(order, last) if len(prompts) == limit else None)

    def lease(self, req: LeaseRequest) -> WantedList:
        """Up to req.limit prompts a generator of req.model_id can serve that no generator holds, leased to it: until a
        group of its model for the prompt is indexed, or req.lease_s by this store's clock."""
        now = time.monotonic()
        with self._lock:
            learners = self._serving(req.model_id)
            seq = self._newest_seq()
            prompts = []
            for _, prompt in self._backlog.walk(req.order, learners):
                held = self._leases.get(prompt)
                if held is not None and held.until > now:
                    continue  # another generator's (or this one's, still sampling it)
                self._leases[prompt] = Lease(req.generator_id, req.model_id, now + req.lease_s, seq)
                prompts.append(self._listed(prompt, learners))
                if len(prompts) == req.limit:
                    break
            return WantedList(prompts=prompts, backlog=len(self._by_prompt))

    def clear_landed(self, groups: GroupSource) -> int:
        """Follow what other writers of the journal added (a lake's other replicas), then clear the wants that groups
        indexed since the last call serve and end the leases they answer; the number cleared."""
        with self._lock:
            self._groups = groups
            new = self.journal.read_new()
            if new is None:  # the journal was rewritten by another writer: read it whole
                self._read_whole()
            else:
                for record in new:
                    self._apply(record)
                self._journal_records += len(new)
            if not self._by_prompt:
                self._seen_seq = groups.newest_seq() - 1
                self._leases.clear()
                return 0
            rows, _ = groups.groups_after(self._seen_seq)
            if not rows:
                return 0
            self._seen_seq = max(seq for seq, _, _ in rows)
            fresh = {prompt for _, prompt, _ in rows if prompt in self._by_prompt or prompt in self._leases}
            cleared = []
            for prompt in fresh:
                refs = groups.prompt_refs(prompt)
                lease = self._leases.get(prompt)
                if lease is not None and any(r.model_id == lease.model and r.seq >= lease.seq for r in refs):
                    del self._leases[prompt]  # its generator's group is in: answered (or all-fail: free for the next)
                cleared += [self._clear_record(want, ref) for want, ref in self._clearing(prompt, refs)]
            self._commit(cleared)
            return len(cleared)

    def _clearing(self, prompt: str, refs: list[GroupRef]) -> list[tuple[OpenWant, GroupRef]]:
        """(want, the group that serves it) for the prompt's open wants that one of `refs` serves: indexed after the
        want, and taken by the wanting learner's rule (without a rule: informative, from another model)."""
        found = []
        for learner in sorted(self._by_prompt.get(prompt, ())):
            want = self._wants[(prompt, learner)]
            rule = self._rules.get(learner)
            step = self._learner_step.get(learner, want.last_step)
            served = self._served.get(learner, {})
            ref = next((r for r in refs if r.seq >= want.seq and (
                rule.takes(learner, step, r.model_id, r.policy_step, r.successes, r.group_size, r.has_mu,
                           served.get(r.group_id, 0)) if rule is not None
                else r.model_id != learner and 0 < r.successes < r.group_size)), None)
            if ref is not None:
                found.append((want, ref))
        return found

    def _clear_record(self, want: OpenWant, ref: GroupRef) -> dict:
        steps = max(0, self._learner_step.get(want.learner, want.last_step) - want.first_step)
        return {"k": "clear", "learner": want.learner, "prompt": want.prompt_id, "group": ref.group_id,
                "model": ref.model_id, "first_at": want.seen_us, "at": now_us(), "steps": steps}

    # ------------------------------------------------------------------ the served ledger

    def serve(self, req: ServedRequest, groups: GroupSource) -> ServedResponse:
        """Add ledger entries; UnknownGroups (nothing recorded) when a group is not in the store."""
        unknown = [gid for gid in dict.fromkeys(req.group_ids) if not groups.select_group(gid)]
        if unknown:
            raise UnknownGroups(f"{len(unknown)} group id(s) this store never had (e.g. {', '.join(unknown[:3])}): "
                                "a ledger entry names a group the learner got from this store's lookups")
        now = now_us()
        times = Counter(req.group_ids)  # a group grafted twice in a step (a prompt drawn twice) counts twice
        with self._lock:
            self._commit([{"k": "served", "learner": req.learner_model, "group": gid, "step": req.policy_step,
                           "at": now, "n": n} for gid, n in times.items()]
                         + [{"k": "step", "learner": req.learner_model, "step": req.policy_step}])
        return ServedResponse(recorded=len(req.group_ids))

    def served_counts(self, learner: str) -> dict[str, int]:
        """group id -> times served to `learner` (the live mapping: lookups read it without copying)."""
        return self._served.get(learner, {})

    def times_served(self, group_id: str) -> dict[str, int]:
        """learner -> times the group was served to it."""
        with self._lock:
            return {learner: groups[group_id] for learner, groups in sorted(self._served.items()) if group_id in groups}

    def needs_ledger(self, req: PeerLookupRequest) -> bool:
        return req.max_times_served is not None or req.order == "least_served"

    # ------------------------------------------------------------------ metrics

    def stats(self) -> BrokerStats:
        with self._lock:
            waits = sorted((c.cleared_us - c.first_us) / 1e6 for c in self._history)
            n = self.within_steps
            decided = len(self._history) + sum(
                1 for w in self._wants.values() if self._learner_step.get(w.learner, w.last_step) - w.first_step > n)
            within = sum(1 for c in self._history if c.steps <= n)
            return BrokerStats(
                backlog_prompts=len(self._by_prompt), backlog_wants=len(self._wants),
                wants_recorded=self._totals["recorded"], wants_cleared=self._totals["cleared"],
                wants_evicted=self._totals["evicted"],
                want_to_group_s_p50=statistics.median(waits) if waits else None,
                want_to_group_s_p90=waits[min(len(waits) - 1, int(0.9 * len(waits)))] if waits else None,
                within_steps=n, served_within_steps_share=within / decided if decided else None,
                ledger_entries=sum(sum(d.values()) for d in self._served.values()),
                ledger_groups=len({g for d in self._served.values() for g in d}))

    # ------------------------------------------------------------------ the journal (under the lock)

    def _read_whole(self) -> None:
        self._reset()
        records = self.journal.read()
        for record in records:
            self._apply(record)
        self._journal_records = len(records)

    def _commit(self, records: list[dict]) -> None:
        """Journal the records (on disk when this returns), then apply them; compact a journal grown past twice
        what the state needs."""
        if not records:
            return
        self.journal.append(records)
        for record in records:
            self._apply(record)
        self._journal_records += len(records)
        if self._journal_records > 2 * self._state_records() + 10_000:
            self.journal.rewrite(self._snapshot())
            self._journal_records = self._state_records()

    def _apply(self, r: dict) -> None:
        kind = r["k"]
        if kind == "want":
            self._apply_want(r)
        elif kind in ("clear", "evict"):
            if self._drop_want(r["prompt"], r["learner"]):
                self._totals["cleared" if kind == "clear" else "evicted"] += 1
            if kind == "clear":
                self._history.append(Cleared(r["first_at"], r["at"], r["steps"]))
        elif kind == "served":
            key = (r["learner"], r["group"])
            whole = "times" in r  # a snapshot's record: the group's count so far
            if not whole and self._served_last.get(key, (None,))[0] == r["step"]:
                return  # the step's entry posted again (a retry after an answer that was lost): it counts once
            groups = self._served.setdefault(r["learner"], {})
            groups[r["group"]] = groups.get(r["group"], 0) + (r["times"] if whole else r.get("n", 1))
            self._served_last[key] = (r["step"], r["at"])
            self._note_step(r["learner"], r["step"])
        elif kind == "rule":
            self._rules[r["learner"]] = WantRule.model_validate(r["rule"])
        elif kind == "step":
            self._note_step(r["learner"], r["step"])
        elif kind == "history":
            self._history.append(Cleared(r["first_at"], r["at"], r["steps"]))
        elif kind == "totals":  # a snapshot's last record: the counts as they were
            self._totals = {name: r[name] for name in self._totals}
        else:
            raise ValueError(f"broker journal {self.journal.path}: unknown record kind {kind!r}: a newer store wrote it?")

    def _apply_want(self, r: dict) -> None:
        key = (r["prompt"], r["learner"])
        if "problem" in r:
            self._problems.setdefault(r["prompt"], (r["dataset"], r["problem"], r["answer"]))
        elif r["prompt"] not in self._problems:
            # another replica's want, posted while it knew the problem, which was cleared here meanwhile: the
            # learner's next miss brings it again
            log.info("broker: a want of %s by %s without its problem, no longer known here: dropped", r["prompt"],
                     r["learner"])
            return
        # Whose seq: this index's own records carry it; another writer's (a lake's other replica) count from now on.
        ours = r.get("by") == self.journal.writer and "seq" in r
        seq, seen = (r["seq"], r["at"]) if ours else (self._newest_seq(), now_us())
        want = self._wants.get(key)
        if want is None:
            self._wants[key] = OpenWant(r["prompt"], r["learner"], r["reason"], r.get("first_at", r["at"]), r["at"],
                                        r.get("first_step", r["step"]), r["step"], r.get("misses", 1), seq,
                                        r.get("seen_at", seen) if ours else seen)
            self._by_prompt.setdefault(r["prompt"], set()).add(r["learner"])
            self._totals["recorded"] += 1
        elif "misses" not in r and want.last_step == r["step"]:
            return  # the same miss posted again (a retry): it counts once
        else:
            want.reason, want.last_us, want.last_step = r["reason"], r["at"], r["step"]
            want.misses += r.get("misses", 1)
            self._wants.move_to_end(key)
        self._note_step(r["learner"], r["step"])
        self._index(r["prompt"])

    def _note_step(self, learner: str, step: int) -> None:
        self._learner_step[learner] = max(self._learner_step.get(learner, 0), step)

    def _index(self, prompt: str) -> None:
        """The prompt's place in the listing order, as its wants stand now."""
        learners = self._by_prompt.get(prompt, set())
        wants = [self._wants[(prompt, learner)] for learner in learners]
        self._backlog.set(prompt, learners, min((w.first_us for w in wants), default=0), sum(w.misses for w in wants))

    def _drop_want(self, prompt: str, learner: str) -> bool:
        if self._wants.pop((prompt, learner), None) is None:
            return False
        learners = self._by_prompt[prompt]
        learners.discard(learner)
        if not learners:
            del self._by_prompt[prompt]
            self._problems.pop(prompt, None)
            self._leases.pop(prompt, None)
        self._index(prompt)
        return True

    def _state_records(self) -> int:
        return (len(self._wants) + len(self._served_last) + len(self._history) + len(self._learner_step)
                + len(self._rules) + 1)

    def _snapshot(self) -> list[dict]:
        """The state as journal records (a rewrite of the journal)."""
        records: list[dict] = [{"k": "history", "first_at": c.first_us, "at": c.cleared_us, "steps": c.steps}
                               for c in self._history]
        records += [{"k": "rule", "learner": learner, "rule": rule.model_dump(exclude_defaults=True)}
                    for learner, rule in self._rules.items()]
        for (prompt, learner), w in self._wants.items():
            dataset, problem, answer = self._problems[prompt]
            records.append({"k": "want", "learner": learner, "prompt": prompt, "reason": w.reason, "step": w.last_step,
                            "at": w.last_us, "first_at": w.first_us, "first_step": w.first_step, "misses": w.misses,
                            "seq": w.seq, "seen_at": w.seen_us, "by": self.journal.writer,
                            "dataset": dataset, "problem": problem, "answer": answer})
        for (learner, group), (step, at) in self._served_last.items():
            records.append({"k": "served", "learner": learner, "group": group, "step": step, "at": at,
                            "times": self._served[learner][group]})
        records += [{"k": "step", "learner": learner, "step": step} for learner, step in self._learner_step.items()]
        records.append({"k": "totals", **self._totals})
        return records


def root_broker(settings: StoreSettings) -> Broker:
    """The broker of a store root (or of a lake replica's cache), journalled in <root>/broker/."""
    return Broker(Journal(settings.root / "broker", settings.root), settings.max_wanted, settings.wanted_within_steps)
