"""The store server's background threads: the ingest loop and the maintenance loop."""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import Counter

from graft.services.store_api.backend import Store
from graft.services.store_api.settings import StoreSettings

log = logging.getLogger("graft.store")


class Background:
    """The ingest loop and the maintenance loop (compaction, deleting retired shards) as daemon threads."""

    def __init__(self, store: Store, settings: StoreSettings, ingested: Counter):
        self.store = store
        self.index = store.index
        self.settings = settings
        self.ingested = ingested
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._ingest, name="store-ingest", daemon=True),
                        threading.Thread(target=self._maintain, name="store-maintenance", daemon=True)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def _ingest(self) -> None:
        while not self.stop.wait(self.settings.ingest_interval_s):
            try:
                self.ingested.inc(self.store.poll())
            except Exception:  # a bad iteration must not stop ingestion; the next one retries
                log.exception("ingest loop iteration failed; retrying in %.1f s", self.settings.ingest_interval_s)

    def _maintain(self) -> None:
        try:
            self.index.ingest.open_lookup_files()
        except Exception:  # lookups rebuild what is missing anyway
            log.exception("opening the lookup files failed")
        last_compaction = time.monotonic()
        while not self.stop.wait(min(5.0, self.settings.compact_interval_s or 5.0)):
            try:
                due = time.monotonic() - last_compaction >= self.settings.compact_interval_s
                if self.settings.compact_interval_s > 0 and due:
                    report = self.index.compaction.compact()
                    last_compaction = time.monotonic()
                    if report["files_written"] or report["files_retired_empty"]:
                        log.info("compaction: %s", report)
                self.index.compaction.delete_retired()
                self.index.ingest.delete_orphan_lookup_files()
            except Exception:
                log.exception("maintenance iteration failed; retrying")
