"""The wanted prompts' order, kept per learner, so that a page of GET /v1/wanted or a lease costs the page, not the
backlog: every prompt a learner wants sits in that learner's two sorted lists (oldest first; most wanted first), under
a key of the prompt's own (the same in every list that holds it). A page for a generator walks the lists of the learners
it can serve, merged, from the cursor on: each step of the walk is O(log learners), and a prompt wanted by several of
them comes once per learner in a row (skipped after the first).

A cursor is the last key a page gave, as opaque text; a page after it starts strictly after that key. The backlog
changes between pages (wants come and go), so pages are of the live list, not of a snapshot.
"""

from __future__ import annotations

import base64
import heapq
from collections.abc import Iterable, Iterator
from typing import Literal

import orjson
from sortedcontainers import SortedList

WantedOrder = Literal["oldest", "most_wanted"]
Key = tuple  # oldest: (first_us, prompt); most_wanted: (-learners, -misses, first_us, prompt)


class BadCursor(ValueError):
    """A cursor this store did not give (or gave for another order)."""


def encode_cursor(order: WantedOrder, key: Key) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([order, *key])).decode().rstrip("=")


def decode_cursor(order: WantedOrder, cursor: str) -> Key:
    try:
        decoded = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, TypeError) as exc:
        raise BadCursor(f"cursor {cursor[:40]!r} is not one this store gave: start again without it") from exc
    size = 2 if order == "oldest" else 4
    if not (isinstance(decoded, list) and len(decoded) == size + 1 and decoded[0] == order
            and all(isinstance(v, int) for v in decoded[1:-1]) and isinstance(decoded[-1], str)):
        raise BadCursor(f"cursor {cursor[:40]!r} is not one this store gave for order {order}: start again without it")
    return tuple(decoded[1:])


class Backlog:
    """Per learner, the prompts it wants in both orders; not thread-safe (the broker's lock guards it)."""

    def __init__(self) -> None:
        self._lists: dict[str, dict[WantedOrder, SortedList]] = {}  # learner -> order -> keys
        self._keys: dict[str, dict[WantedOrder, Key]] = {}  # prompt -> its keys now
        self._learners: dict[str, frozenset[str]] = {}  # prompt -> the learners whose lists hold it

    def set(self, prompt: str, learners: Iterable[str], first_us: int, misses: int) -> None:
        """The prompt as it stands now: wanted by `learners` (none: gone), first missed at `first_us`, `misses` in all."""
        learners = frozenset(learners)
        old_keys, old_learners = self._keys.get(prompt), self._learners.get(prompt, frozenset())
        keys: dict[WantedOrder, Key] = {"oldest": (first_us, prompt),
                                        "most_wanted": (-len(learners), -misses, first_us, prompt)}
        for learner in old_learners:
            for order, key in old_keys.items():
                if learner not in learners or keys[order] != key:
                    self._lists[learner][order].remove(key)
            if learner not in learners and not self._lists[learner]["oldest"]:
                del self._lists[learner]
        if not learners:
            self._keys.pop(prompt, None)
            self._learners.pop(prompt, None)
            return
        for learner in learners:
            lists = self._lists.setdefault(learner, {"oldest": SortedList(), "most_wanted": SortedList()})
            for order, key in keys.items():
                if learner not in old_learners or old_keys[order] != key:
                    lists[order].add(key)
        self._keys[prompt], self._learners[prompt] = keys, learners

    def learners(self) -> list[str]:
        """The learners with wants."""
        return list(self._lists)

    def walk(self, order: WantedOrder, learners: list[str], after: Key | None = None) -> Iterator[tuple[Key, str]]:
        """(key, prompt) of the prompts `learners` want, in `order`, from just after `after` on, each once."""
        walks = [self._lists[learner][order].irange(minimum=after, inclusive=(False, True)) if after is not None
                 else iter(self._lists[learner][order]) for learner in learners if learner in self._lists]
        previous = None
        for key in heapq.merge(*walks):
            if key != previous:  # a prompt's key is the same in each list holding it: they come in a row
                yield key, key[-1]
            previous = key
