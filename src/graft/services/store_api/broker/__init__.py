"""The store as a broker between learners and generators: wanted prompts, leases, the served ledger and co-trainers' heartbeats (`Broker`), kept in a
durable journal (`Journal`). A store (backend.py) composes one beside its index."""

from graft.services.store_api.broker.backlog import BadCursor, WantedOrder
from graft.services.store_api.broker.broker import Broker, UnknownGroups, UnknownPrompts, root_broker
from graft.services.store_api.broker.journal import Journal

__all__ = ["BadCursor", "Broker", "Journal", "UnknownGroups", "UnknownPrompts", "WantedOrder", "root_broker"]
