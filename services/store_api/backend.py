"""The store the API and the CLI work on: the local index of a store root, or (backend 'lake') a replica of a lake,
which is the same index over a cache that follows the lake. Its own module so that the index and the replica,
which builds on the index, do not import each other."""

from __future__ import annotations

from services.store_api.index import StoreIndex
from services.store_api.settings import StoreSettings


def store_backend(settings: StoreSettings) -> StoreIndex:
    """`settings.root`'s StoreIndex, or a LakeReplica when settings.backend is 'lake' (its lake modules load then)."""
    if settings.backend == "lake":
        from services.store_api.replica import LakeReplica

        return LakeReplica(settings)
    return StoreIndex(settings)
