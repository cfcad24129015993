"""Rewards with math-verify, in worker processes, with a per-item timeout.

math-verify's own timeouts use SIGALRM and fail off the main thread, and sympy can take
arbitrarily long on adversarial answers. So every comparison runs in a worker process's main
thread under a per-item interval timer; the parent also kills a worker that stops answering.
The gold is wrapped in `\\boxed{}` before parsing (a bare gold string is misread), the model's
last `\\boxed{}` is extracted here and parsed the same way, and the gold goes first to verify().
Reward is null when the gold cannot be parsed, 0 on timeout or when there is no boxed answer.

Results are cached in the parent by (extracted answer, gold): a cached item costs a dict look-up,
no IPC. Short answers repeat a lot (the toy prototype saw 94% hits). The cache keeps the most
recently used CACHE_SIZE items. A worker that dies or stops answering is replaced (its item scores 0).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding graft/: the checkout's src/, or site-packages
TINY_MAGNITUDE = 1e-9  # below this, math-verify's absolute comparison cannot tell numbers apart
TINY_RELATIVE_TOLERANCE = 1e-6
WORKER_GRACE_S = 10.0  # beyond the per-item timeout, before the parent kills a silent worker
WORKER_START_TIMEOUT_S = 120.0  # spawning a worker imports sympy: slow on a busy machine
PARSE_CACHE_SIZE = 65_536  # parsed answers kept per worker
CACHE_SIZE = 262_144  # (answer, gold) rewards kept in the parent, least recently used dropped first

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Score:
    reward: float | None  # 1.0 correct, 0.0 wrong / no boxed answer / timeout, None when the gold does not parse
    correct: bool  # reward > 0
    extracted_answer: str | None  # the completion's final answer (its last \boxed{} by default), None without one


_BOXED_TOKENS = re.compile(r"\\boxed|\\fbox|[{}]")
_BARE_ANSWER = re.compile(r"\s*([^\s$]+)")  # `\boxed 5`: the answer runs to the next whitespace or `$`


def extract_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, braces balanced; None if none.

    One backward pass over the commands and braces: each `{` is matched to its `}` with a stack, so a
    completion cut off inside many unclosed boxes costs one scan, not one scan per box."""
    closing: list[int] = []  # positions of the `}` after the scan's position not matched yet, nearest last
    opened_at, matched = -1, None  # the last `{` seen (the scan's leftmost) and its `}`
    for token in reversed(list(_BOXED_TOKENS.finditer(text))):
        kind, start = token.group(), token.start()
        if kind == "}":
            closing.append(start)
        elif kind == "{":
            opened_at, matched = start, (closing.pop() if closing else None)
        else:
            after = token.end()
            if opened_at == after:
                if matched is not None:
                    return text[after + 1 : matched].strip()
                # Unbalanced (the completion was cut off inside the box): look for an earlier, complete one.
            elif text.startswith(" ", after):
                bare = _BARE_ANSWER.match(text, after)
                if bare:
                    return bare.group(1)
    return None


ANSWER_RULES = ("boxed", "gsm8k", "answer_tag", "regex")
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def answer_extractor(rule: str, pattern: str | None = None) -> Callable[[str], str | None]:
    """The function that takes a completion's final answer by a run's rule (None when it gives none):
    - boxed: the last `\\boxed{}` (graft's own);
    - gsm8k: the last `#### <number>` (GSM8K's solutions, verl's gsm8k reward's strict rule), commas and `$` removed;
    - answer_tag: the last `<answer>...</answer>` (the R1-style format reward TRL recipes use);
    - regex: the last match of `pattern` (its first group if it has one)."""
    if rule == "boxed":
        return extract_last_boxed
    if rule == "gsm8k":
        return _last_gsm8k_answer
    if rule == "answer_tag":
        return _last_answer_tag
    if rule == "regex":
        if not pattern:
            raise ValueError("answer rule regex needs a pattern (extract_regex)")
        compiled = re.compile(pattern, re.S)

        def last_match(text: str) -> str | None:
            found = None
            for found in compiled.finditer(text):  # noqa: B007 (the last one is kept)
                pass
            if found is None:
                return None
            return (found.group(1) if compiled.groups else found.group(0)).strip()

        return last_match
    raise ValueError(f"unknown answer rule {rule!r}: one of {', '.join(ANSWER_RULES)}")


def _last_gsm8k_answer(text: str) -> str | None:
    found = _GSM8K_ANSWER.findall(text)
    return found[-1].replace(",", "").replace("$", "") if found else None


def _last_answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


class ItemTimeout(BaseException):
    """Raised by the worker's interval timer. A BaseException so that sympy's and math-verify's
    `except Exception` clauses cannot swallow it."""


def _on_alarm(signum, frame):
    raise ItemTimeout()


def _tiny_numbers_differ(parsed_gold: list, parsed_pred: list) -> bool:
    """True for two different numbers that math-verify called equal because both are tiny.

    math-verify compares numbers that are not single atoms (`1.3 \\times 10^{-27}` is a product) by
    `(a - b).evalf(chop=True) == 0`, and chop rounds anything below ~1e-15 to zero: any two tiny
    numbers compare equal. Minerva's physical constants live there (1.325e-27 "equalled" 2.88e-19).
    For them we require the relative agreement that rounding to 6 decimals asks of ordinary numbers.
    """
    from sympy import Basic

    gold, pred = parsed_gold[0], parsed_pred[0]
    if not (isinstance(gold, Basic) and isinstance(pred, Basic) and gold.is_number and pred.is_number):
        return False
    try:
        g, p = complex(gold.evalf(30)), complex(pred.evalf(30))
    except (TypeError, ValueError):
        return False
    scale = max(abs(g), abs(p))
    return scale < TINY_MAGNITUDE and abs(g - p) > TINY_RELATIVE_TOLERANCE * scale


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def _parse_answer(extracted: str) -> list:
    """math-verify's parse of an extracted answer, cached in the worker: parsing (about 1 ms) is nearly all
    of an item's cost, and answers repeat across problems (a parse that times out raises and is not cached)."""
    from math_verify import parse

    return parse("\\boxed{" + extracted + "}", parsing_timeout=None)


def _score_one(extracted: str | None, gold: str, timeout_s: float, gold_cache: dict) -> tuple[float | None, bool | None, bool]:
    """(reward, gold parses, timed out) for one item, inside a worker; gold parses is None when unknown."""
    from math_verify import parse, verify

    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        if gold not in gold_cache:
            gold_cache[gold] = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        parsed_gold = gold_cache[gold]
        if not parsed_gold:
            return None, False, False
        if extracted is None:
            return 0.0, True, False
        parsed_pred = _parse_answer(extracted)
        if not parsed_pred:
            return 0.0, True, False
        if not verify(parsed_gold, parsed_pred, timeout_seconds=None):
            return 0.0, True, False
        return (0.0 if _tiny_numbers_differ(parsed_gold, parsed_pred) else 1.0), True, False
    except ItemTimeout:
        return 0.0, (bool(gold_cache[gold]) if gold in gold_cache else None), True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _worker_main(fd: int, timeout_s: float) -> None:
    """A scoring worker on socket `fd`: receives lists of (index, extracted, gold), answers (index, reward, gold_ok, timed_out) per item."""
    import logging

    import math_verify  # noqa: F401  (import sympy once, before the first item's timer starts)

    # math-verify logs a warning when timeouts are disabled; ours is the interval timer.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops us cleanly
    gold_cache: dict = {}
    conn = Connection(fd)
    conn.send("ready")
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        if items is None:
            return
        for index, extracted, gold in items:
            conn.send((index, *_score_one(extracted, gold, timeout_s, gold_cache)))


class _Worker:
    """One scoring process, started with `python -c` rather than multiprocessing: fork would copy the
    parent's torch threads, and spawn would re-run the caller's `__main__` module."""

    def __init__(self, timeout_s: float):
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])))
        code = f"from graft.rollouts.scoring import _worker_main; _worker_main({child_end.fileno()}, {timeout_s!r})"
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child_end.fileno()], env=env)
        child_end.close()
        self.conn = Connection(parent_end.detach())
        self.ready = False
        self.items: list[tuple[int, str | None, str]] = []  # sent and not yet answered, in order
        self.deadline = math.inf

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(WORKER_START_TIMEOUT_S):
            raise RuntimeError(f"a scoring worker did not start within {WORKER_START_TIMEOUT_S} s (is math-verify installed?)")
        try:
            first = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"a scoring worker exited at startup (exit code {self.process.wait()}): "
                               "is math-verify installed? Its error is above") from None
        if first != "ready":
            raise RuntimeError("a scoring worker sent an unexpected first message")
        self.ready = True

    def send(self, items: list[tuple[int, str | None, str]], deadline_s: float) -> None:
        """Hand the worker `items`; raises OSError (BrokenPipeError) when it has died."""
        self.items = items
        if items:
            self.conn.send(items)
            self.deadline = time.monotonic() + deadline_s

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


class Scorer:
    """math-verify rewards from a pool of worker processes, cached by (extracted answer, gold).

    Safe to call from any thread (calls are serialised). Use as a context manager or call close().
    A worker that stops answering or dies is replaced; the item it held scores 0 (counted in `timeouts`).
    """

    def __init__(self, num_workers: int = 1, timeout_s: float = 5.0, grace_s: float = WORKER_GRACE_S,
                 cache_size: int = CACHE_SIZE):
        if num_workers < 1:
            raise ValueError(f"Scorer(num_workers={num_workers}): need at least one worker")
        if timeout_s <= 0:
            raise ValueError(f"Scorer(timeout_s={timeout_s}): the per-item timeout must be positive")
        if cache_size < 1:
            raise ValueError(f"Scorer(cache_size={cache_size}): the cache must hold at least one item")
        self.timeout_s = timeout_s
        self.grace_s = grace_s  # beyond timeout_s, before a silent worker is killed and replaced
        # Least recently used first: a continuous run meets new answers without end, so the cache is bounded.
        self.cache: OrderedDict[tuple[str | None, str], float | None] = OrderedDict()
        self.cache_size = cache_size
        self.gold_parses: dict[str, bool] = {}  # one entry per gold: bounded by the data set
        self.timeouts = 0  # items that hit the per-item timeout or whose worker stopped or died (reward 0)
        self.workers_replaced = 0  # workers killed (stuck) or found dead, and started afresh
        self._lock = threading.Lock()
        self._workers = [_Worker(timeout_s) for _ in range(num_workers)]

    def score(self, completions: list[str], golds: list[str],
              extract: Callable[[str], str | None] = extract_last_boxed) -> list[Score]:
        """Each completion's reward against its gold; `extract` takes its final answer (`answer_extractor`)."""
        if len(completions) != len(golds):
            raise ValueError(f"score() got {len(completions)} completions but {len(golds)} golds: pass one gold per completion")
        extracted = [extract(c) for c in completions]
        with self._lock:
            known: dict[tuple[str | None, str], float | None] = {}
            missing = []
            for key in dict.fromkeys(zip(extracted, golds)):
                if key in self.cache:
                    self.cache.move_to_end(key)
                    known[key] = self.cache[key]
                elif key[0] is None and key[1] in self.gold_parses:
                    # No boxed answer: the reward only depends on whether the gold parses.
                    known[key] = 0.0 if self.gold_parses[key[1]] else None
                    self._remember(key, known[key])
                else:
                    missing.append(key)
            if missing:
                scored = self._score_in_workers(missing)
                for key, reward in scored.items():
                    self._remember(key, reward)
                known.update(scored)
            rewards = [known.get(key, 0.0) for key in zip(extracted, golds)]  # not known: timed out, reward 0
        return [
            Score(reward=reward, correct=reward is not None and reward > 0, extracted_answer=answer)
            for reward, answer in zip(rewards, extracted)
        ]

    def _remember(self, key: tuple[str | None, str], reward: float | None) -> None:
        self.cache[key] = reward
        self.cache.move_to_end(key)
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    def _score_in_workers(self, keys: list[tuple[str | None, str]]) -> dict[tuple[str | None, str], float | None]:
        """Rewards of `keys` (those that timed out are left out: reward 0, not cached, the machine may just have been busy)."""
        deadline_s = self.timeout_s + self.grace_s
        for worker in list(self._workers):
            if worker.process.poll() is not None:  # died since the last call, holding no item of this one
                worker = self._replace(worker, "died between calls")
            worker.wait_ready()
        # Round-robin so that slow items spread over the workers.
        for w, worker in enumerate(self._workers):
            items = [(i, *keys[i]) for i in range(w, len(keys), len(self._workers))]
            try:
                worker.send(items, deadline_s)
            except OSError:  # it died after the check above, before taking anything
                self._replace(worker, "died before taking its items").send(items, deadline_s)
        scored: dict[tuple[str | None, str], float | None] = {}
        while any(worker.items for worker in self._workers):
            busy = [worker for worker in self._workers if worker.items]
            timeout = max(0.0, min(worker.deadline for worker in busy) - time.monotonic())
            ready = wait([worker.conn for worker in busy], timeout=timeout)
            for worker in busy:
                if worker.conn in ready:
                    try:
                        index, reward, gold_ok, timed_out = worker.conn.recv()
                    except (EOFError, OSError):  # it died mid-item (killed, out of memory, a crash in sympy's C code)
                        self._replace_holding(worker, "died")
                        continue
                    assert index == worker.items[0][0], "scoring worker answered out of order"
                    worker.items.pop(0)
                    worker.deadline = time.monotonic() + deadline_s
                    key = keys[index]
                    if gold_ok is not None:
                        self.gold_parses[key[1]] = gold_ok
                    if timed_out:
                        self.timeouts += 1
                        continue
                    scored[key] = reward
                elif time.monotonic() >= worker.deadline:
                    # Stuck outside Python, where the interval timer cannot interrupt it.
                    self._replace_holding(worker, f"stopped answering for {deadline_s:.0f} s")
        return scored

    def _replace_holding(self, worker: _Worker, what: str) -> None:
        """A worker lost while holding items: its current item scores 0, the rest go to a fresh worker."""
        self.timeouts += 1
        remaining = worker.items[1:]
        self._replace(worker, what + " holding an item, which scores 0").send(remaining, self.timeout_s + self.grace_s)

    def _replace(self, worker: _Worker, what: str) -> _Worker:
        worker.kill()
        log.warning("a scoring worker (pid %d, exit code %s) %s; starting a fresh one", worker.process.pid,
                    worker.process.returncode, what)
        self.workers_replaced += 1
        fresh = _Worker(self.timeout_s)
        fresh.wait_ready()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        with self._lock:
            for worker in self._workers:
                worker.close()
            self._workers = []

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
