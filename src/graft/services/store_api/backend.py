"""The store the API and the CLI work on (`Store`): a store root's own index, or (backend 'lake') a replica of a
lake, which uses an index of its own over a cache that follows the lake. Both answer lookups, pages and stats from
`store.index`; they differ in where new groups come from (`poll`) and where a push goes."""

from __future__ import annotations

from typing import Protocol

import pyarrow as pa

from graft.schemas import Problem, StatsResponse
from graft.services.store_api.broker import Broker, root_broker
from graft.services.store_api.local import StoreIndex
from graft.services.store_api.settings import StoreSettings


class Store(Protocol):
    settings: StoreSettings
    index: StoreIndex  # what lookups, rollout pages, the browser and maintenance run on
    broker: Broker  # wanted prompts and the served ledger

    def open(self) -> Store: ...
    def close(self) -> None: ...
    def rebuild(self) -> int: ...
    def poll(self) -> int: ...  # the ingest loop's call: groups added since the last one
    def push(self, table: pa.Table, problems: list[Problem]) -> tuple[int, list[str], str | None]: ...
    def stats(self) -> StatsResponse: ...


class LocalStore:
    """A store root's own index: new groups come from writers' shards (found each poll) and pushes."""

    def __init__(self, settings: StoreSettings):
        self.settings = settings
        self.index = StoreIndex(settings)
        self.broker = root_broker(settings)

    def open(self) -> LocalStore:
        self.index.open()
        self.broker.open(self.index.queries)
        return self

    def close(self) -> None:
        self.broker.close()
        self.index.close()

    def rebuild(self) -> int:
        return self.index.rebuild()

    def poll(self) -> int:
        added = self.index.ingest.ingest_new()
        self.broker.clear_landed(self.index.queries)
        return added

    def push(self, table: pa.Table, problems: list[Problem]) -> tuple[int, list[str], str | None]:
        return self.index.ingest.push(table, problems)

    def stats(self) -> StatsResponse:
        return self.index.queries.stats().model_copy(update={"broker": self.broker.stats()})


def store_backend(settings: StoreSettings) -> Store:
    """`settings.root`'s LocalStore, or a LakeReplica when settings.backend is 'lake' (its lake modules load then)."""
    if settings.backend == "lake":
        from graft.services.store_api.lake.replica import LakeReplica

        return LakeReplica(settings)
    return LocalStore(settings)
