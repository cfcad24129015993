"""The store as a two-way broker: a learner's misses become the generators' work (wanted prompts), and a served
ledger lets a lookup limit and order what it serves (`PeerLookupRequest.max_times_served`, `order`).

`Broker` owns both, in memory, and keeps them in a `Journal` (journal.py: appended and fsynced before a call
returns, rewritten atomically to the current state when it has grown; a restart reads it back):
- a want is (prompt, learner): the reason of the learner's last miss, first and last time and step, how many
  misses. At most `max_wanted` are open; past that the least recently missed goes (counted as evicted). The
  problem's text and answer come with the first want of a prompt, so that a generator can sample it.
- a want is cleared when an informative group (`PeerLookupRequest.informative_sql`'s rule: 0 < successes < group
  size) of the prompt from a model other than the learner lands, created after the want (`clear_landed`, called by
  the ingest loop after each poll; it reads the index through its queries, `index.queries`).
- the ledger counts, per learner, how often each group was served (POST /v1/served: what the learner grafted), with
  the step and time of the last entry. An entry for a group the store never had is refused (`UnknownGroups`).

Metrics (`stats`): backlog, seconds from a want to the group that cleared it, and the share of wants cleared within N
of the learner's steps (its steps as it reports them with wants and ledger entries).
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal, Protocol

from graft.schemas import (
    BrokerStats,
    PeerLookupRequest,
    ServedRequest,
    ServedResponse,
    WantedList,
    WantedPrompt,
    WantedRequest,
    WantedResponse,
)
from graft.services.store_api.broker.journal import Journal
from graft.services.store_api.local import GroupRef, now_us, us_to_datetime
from graft.services.store_api.settings import StoreSettings

log = logging.getLogger("graft.store")
HISTORY = 10_000  # cleared wants kept for the metrics (the most recent)
WantedOrder = Literal["oldest", "most_wanted"]


class GroupSource(Protocol):
    """What the broker reads of a store's index: its queries (`index.queries`, IndexQueries)."""

    def prompt_refs(self, prompt_id: str) -> list[GroupRef]: ...
    def select_group(self, group_id: str) -> list[GroupRef]: ...
    def groups_after(self, seq: int) -> tuple[list[tuple[int, str, str]], int]: ...
    def newest_seq(self) -> int: ...


class JournalStore(Protocol):
    """Where a broker keeps its records: a store root's file (journal.py) or a lake's table (lake/journal.py)."""

    path: object  # named in messages

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


@dataclass(frozen=True)
class Cleared:
    first_us: int
    cleared_us: int
    steps: int  # the learner's steps from the want to the clearing (as far as it reported them)


class Broker:
    """Wanted prompts and the served ledger of one store; thread-safe."""

    def __init__(self, journal: JournalStore, max_wanted: int, within_steps: int):
        self.journal = journal
        self.max_wanted = max_wanted
        self.within_steps = within_steps
        self._lock = threading.Lock()
        self._reset()
        self._seen_seq = 0

    def _reset(self) -> None:
        """An empty state (before the journal is read)."""
        self._wants: OrderedDict[tuple[str, str], OpenWant] = OrderedDict()  # least recently missed first
        self._by_prompt: dict[str, set[str]] = {}  # prompt -> learners with an open want
        self._problems: dict[str, tuple[str, str, str]] = {}  # prompt -> (dataset, problem, answer)
        self._learner_step: dict[str, int] = {}
        self._served: dict[str, dict[str, int]] = {}  # learner -> group -> times
        self._served_last: dict[tuple[str, str], tuple[int, int]] = {}  # (learner, group) -> (step, us) of the last
        self._history: deque[Cleared] = deque(maxlen=HISTORY)
        self._totals = {"recorded": 0, "cleared": 0, "evicted": 0}
        self._journal_records = 0

    # ------------------------------------------------------------------ lifecycle

    def open(self, groups: GroupSource) -> Broker:
        """Read the journal back, clear what groups landed while the store was down, compact the journal."""
        with self._lock:
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

    # ------------------------------------------------------------------ wants

    def want(self, req: WantedRequest) -> WantedResponse:
        """Record a learner's misses; UnknownPrompts (nothing recorded) when a prompt is new to the store and its
        want brings no problem."""
        now = now_us()
        with self._lock:
            unknown = [w.prompt_id for w in req.wants if w.problem is None and w.prompt_id not in self._problems]
            if unknown:
                raise UnknownPrompts(
                    f"{len(unknown)} wanted prompt id(s) unknown to this store (e.g. {', '.join(unknown[:3])}): send "
                    "each new prompt's problem (dataset, problem, answer) with its first want, so that a generator "
                    "can sample it")
            records: list[dict] = []
            for w in req.wants:
                record = {"k": "want", "learner": req.learner_model, "prompt": w.prompt_id, "reason": w.reason,
                          "step": req.policy_step, "at": now}
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

    def wanted(self, model: str | None, order: WantedOrder, limit: int) -> WantedList:
        """The prompts wanted by learners other than `model` (a model's own groups never clear its own want),
        oldest want first or most wanted (most learners, then most misses) first."""
        with self._lock:
            prompts: list[WantedPrompt] = []
            for prompt, learners in self._by_prompt.items():
                wants = [self._wants[(prompt, learner)] for learner in sorted(learners) if learner != model]
                if not wants:
                    continue
                dataset, problem, answer = self._problems[prompt]
                prompts.append(WantedPrompt(
                    prompt_id=prompt, dataset=dataset, problem=problem, answer=answer,
                    learners=[w.learner for w in wants], reasons=[w.reason for w in wants],
                    first_wanted_at=us_to_datetime(min(w.first_us for w in wants)),
                    last_wanted_at=us_to_datetime(max(w.last_us for w in wants)), misses=sum(w.misses for w in wants)))
        if order == "oldest":
            prompts.sort(key=lambda p: (p.first_wanted_at, p.prompt_id))
        else:
            prompts.sort(key=lambda p: (-len(p.learners), -p.misses, p.first_wanted_at, p.prompt_id))
        return WantedList(prompts=prompts[:limit], backlog=len(prompts))

    def clear_landed(self, groups: GroupSource) -> int:
        """Follow what other writers of the journal added (a lake's other replicas), then clear the wants that groups
        indexed since the last call serve; the number cleared."""
        with self._lock:
            new = self.journal.read_new()
            if new is None:  # the journal was rewritten by another writer: read it whole
                self._read_whole()
            else:
                for record in new:
                    self._apply(record)
                self._journal_records += len(new)
            if not self._by_prompt:
                self._seen_seq = groups.newest_seq() - 1
                return 0
            rows, _ = groups.groups_after(self._seen_seq)
            if not rows:
                return 0
            self._seen_seq = max(seq for seq, _, _ in rows)
            fresh = {prompt for _, prompt, _ in rows if prompt in self._by_prompt}
            cleared = [self._clear_record(want, ref) for prompt in fresh
                       for want, ref in self._clearing(prompt, groups.prompt_refs(prompt))]
            self._commit(cleared)
            return len(cleared)

    def _clearing(self, prompt: str, refs: list[GroupRef]) -> list[tuple[OpenWant, GroupRef]]:
        """(want, the group that serves it) for the prompt's open wants that one of `refs` serves: informative, from
        another model, created after the want."""
        informative = [r for r in refs if 0 < r.successes < r.group_size]
        found = []
        for learner in sorted(self._by_prompt.get(prompt, ())):
            want = self._wants[(prompt, learner)]
            ref = next((r for r in informative if r.model_id != learner and r.created_us >= want.first_us), None)
            if ref is not None:
                found.append((want, ref))
        return found

    def _clear_record(self, want: OpenWant, ref: GroupRef) -> dict:
        steps = max(0, self._learner_step.get(want.learner, want.last_step) - want.first_step)
        return {"k": "clear", "learner": want.learner, "prompt": want.prompt_id, "group": ref.group_id,
                "model": ref.model_id, "first_at": want.first_us, "at": now_us(), "steps": steps}

    # ------------------------------------------------------------------ the served ledger

    def serve(self, req: ServedRequest, groups: GroupSource) -> ServedResponse:
        """Add ledger entries; UnknownGroups (nothing recorded) when a group is not in the store."""
        unknown = [gid for gid in dict.fromkeys(req.group_ids) if not groups.select_group(gid)]
        if unknown:
            raise UnknownGroups(f"{len(unknown)} group id(s) this store never had (e.g. {', '.join(unknown[:3])}): "
                                "a ledger entry names a group the learner got from this store's lookups")
        now = now_us()
        with self._lock:
            self._commit([{"k": "served", "learner": req.learner_model, "group": gid, "step": req.policy_step,
                           "at": now} for gid in req.group_ids]
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
            key = (r["prompt"], r["learner"])
            if "problem" in r:
                self._problems.setdefault(r["prompt"], (r["dataset"], r["problem"], r["answer"]))
            elif r["prompt"] not in self._problems:
                # another replica's want, posted while it knew the problem, which was cleared here meanwhile: the
                # learner's next miss brings it again
                log.info("broker: a want of %s by %s without its problem, no longer known here: dropped", r["prompt"],
                         r["learner"])
                return
            want = self._wants.get(key)
            if want is None:
                self._wants[key] = OpenWant(r["prompt"], r["learner"], r["reason"], r.get("first_at", r["at"]), r["at"],
                                            r.get("first_step", r["step"]), r["step"], r.get("misses", 1))
                self._by_prompt.setdefault(r["prompt"], set()).add(r["learner"])
                self._totals["recorded"] += 1
            else:
                want.reason, want.last_us, want.last_step = r["reason"], r["at"], r["step"]
                want.misses += r.get("misses", 1)
                self._wants.move_to_end(key)
            self._learner_step[r["learner"]] = max(self._learner_step.get(r["learner"], 0), r["step"])
        elif kind in ("clear", "evict"):
            if self._drop_want(r["prompt"], r["learner"]):
                self._totals["cleared" if kind == "clear" else "evicted"] += 1
            if kind == "clear":
                self._history.append(Cleared(r["first_at"], r["at"], r["steps"]))
        elif kind == "served":
            groups = self._served.setdefault(r["learner"], {})
            groups[r["group"]] = groups.get(r["group"], 0) + r.get("times", 1)
            self._served_last[(r["learner"], r["group"])] = (r["step"], r["at"])
            self._learner_step[r["learner"]] = max(self._learner_step.get(r["learner"], 0), r["step"])
        elif kind == "step":
            self._learner_step[r["learner"]] = max(self._learner_step.get(r["learner"], 0), r["step"])
        elif kind == "history":
            self._history.append(Cleared(r["first_at"], r["at"], r["steps"]))
        elif kind == "totals":  # a snapshot's last record: the counts as they were
            self._totals = {name: r[name] for name in self._totals}
        else:
            raise ValueError(f"broker journal {self.journal.path}: unknown record kind {kind!r}: a newer store wrote it?")

    def _drop_want(self, prompt: str, learner: str) -> bool:
        if self._wants.pop((prompt, learner), None) is None:
            return False
        learners = self._by_prompt[prompt]
        learners.discard(learner)
        if not learners:
            del self._by_prompt[prompt]
            self._problems.pop(prompt, None)
        return True

    def _state_records(self) -> int:
        return len(self._wants) + len(self._served_last) + len(self._history) + len(self._learner_step) + 1

    def _snapshot(self) -> list[dict]:
        """The state as journal records (a rewrite of the journal)."""
        records: list[dict] = [{"k": "history", "first_at": c.first_us, "at": c.cleared_us, "steps": c.steps}
                               for c in self._history]
        for (prompt, learner), w in self._wants.items():
            dataset, problem, answer = self._problems[prompt]
            records.append({"k": "want", "learner": learner, "prompt": prompt, "reason": w.reason, "step": w.last_step,
                            "at": w.last_us, "first_at": w.first_us, "first_step": w.first_step, "misses": w.misses,
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
