"""Heartbeats of lockstep co-trainers: each trainer tells the store every few seconds that it lives, at which step, and
whether it waits for its partners; a partner reads them to tell a trainer that is busy (an evaluation, a checkpoint)
from one that is gone. In memory only: liveness is of now, and a restarted store learns it again at the next beats.
A reader judges progress by `beats` changing, on its own clock; `age_s` is by this store's clock alone."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from graft.schemas import Heartbeat, HeartbeatRequest

MAX_TRAINERS = 10_000  # heartbeats kept (the least recently heard go first): a bound against a flood of model ids


@dataclass
class _Beat:
    beats: int
    step: int
    waiting: bool
    at: float  # time.monotonic() of this store


class Heartbeats:
    """model id -> its last heartbeat; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[str, _Beat] = {}

    def beat(self, req: HeartbeatRequest) -> None:
        with self._lock:
            previous = self._beats.pop(req.model_id, None)
            self._beats[req.model_id] = _Beat((previous.beats if previous else 0) + 1, req.step, req.waiting,
                                              time.monotonic())
            if len(self._beats) > MAX_TRAINERS:
                del self._beats[next(iter(self._beats))]

    def of(self, models: list[str]) -> dict[str, Heartbeat]:
        now = time.monotonic()
        with self._lock:
            return {model: Heartbeat(model_id=model, beats=b.beats, step=b.step, waiting=b.waiting, age_s=now - b.at)
                    for model in dict.fromkeys(models) if (b := self._beats.get(model)) is not None}
