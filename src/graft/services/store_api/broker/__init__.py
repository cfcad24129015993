"""The store as a broker between learners and generators: wanted prompts and the served ledger (`Broker`), kept in a
durable journal (`Journal`). A store (backend.py) composes one beside its index."""

from graft.services.store_api.broker.broker import Broker, UnknownGroups, UnknownPrompts, WantedOrder, root_broker
from graft.services.store_api.broker.journal import Journal

__all__ = ["Broker", "Journal", "UnknownGroups", "UnknownPrompts", "WantedOrder", "root_broker"]
