"""The store's Prometheus metrics (GET /metrics): one registry per app, so that two apps in one process count apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.lookups = Counter("graft_store_lookups", "peer lookup requests", registry=registry)
        self.lookup_seconds = Histogram("graft_store_lookup_seconds", "peer lookup latency", registry=registry,
                                        buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5))
        self.lookup_misses = Counter("graft_store_lookup_misses", "prompts a peer lookup found nothing for",
                                     registry=registry)
        self.ingested = Counter("graft_store_groups_ingested", "groups indexed by the ingest loop", registry=registry)
        self.pushed = Counter("graft_store_groups_pushed", "groups accepted by POST /v1/groups", registry=registry)
        self.groups = Gauge("graft_store_groups", "groups in the index", registry=registry)
