"""A stop asked for by a signal, for the loops that must end between two units of work (graft-generate's batch,
graft-train's step): SIGTERM is `docker stop` and a scheduler's preemption, and the loop finishes what it holds (the
batch stored, the step checkpointed) instead of dying in the middle of it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from typing import Any


class StopFlag:
    """`requested` turns True on one of `signals`; the loop reads it between units of work and stops. Only the main
    thread can set signal handlers: elsewhere `install` does nothing and the signals keep their default (the caller
    sets `requested` itself). With SIGINT among the signals, a second Ctrl-C stops at once (KeyboardInterrupt)."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.requested = False
        self.signals = tuple(signals)
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = True  # only a flag: the handler may interrupt any code, logging's locks included
