"""What GRAFT needs where verl's TaskRunner runs, checked there before verl starts a worker.

The TaskRunner (a Ray actor; `GraftPPOTrainer._setup` runs in it) looks up peer groups in the store, loads the peers'
tokenizers and fingerprints `actor_rollout_ref.model.path`: with several nodes Ray may place it on any of them, where
`127.0.0.1` is that node itself and a local directory may not exist. So, on that node: a loopback store URL is refused
when the Ray cluster has more than one node, and the store must answer; `GraftPPOTrainer.graft_setup` then loads the
peer tokenizers, naming the node where one does not load."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

from graft.services.store_api.http.client import StoreClient, StoreError
from graft.trainer import StoreConfig


def where_this_runs() -> str:
    """This process's node and working directory, as the errors name them (a relative path resolves there)."""
    return f"node {socket.gethostname()}, working directory {os.getcwd()}"


def ray_nodes() -> int:
    """Alive nodes of the Ray cluster this process is part of (1 outside Ray)."""
    import ray

    if not ray.is_initialized():
        return 1
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def is_loopback(host: str | None) -> bool:
    """Whether `host` names this machine only (localhost, 127.0.0.0/8, ::1, or the unspecified 0.0.0.0 / ::)."""
    if host is None or host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def preflight(store: StoreConfig) -> None:
    """Refuse a loopback store URL on a cluster of several nodes; check that the store answers from here."""
    url = store.url
    nodes = ray_nodes()
    if nodes > 1 and is_loopback(urlsplit(url).hostname):
        raise ValueError(f"graft.store_url={url} is a loopback address, and this Ray cluster has {nodes} nodes: verl's "
                         "TaskRunner, which asks the store for peer groups, runs on whichever node Ray places it "
                         f"(this time {where_this_runs()}); give the store's address as every node reaches it")
    try:
        with StoreClient(url, token=store.token, timeout_s=store.timeout_s, retries=store.retries) as client:
            client.health()
    except (StoreError, OSError) as exc:
        raise RuntimeError(f"graft.store_url={url} does not answer where verl's TaskRunner runs "
                           f"({where_this_runs()}): {exc}") from exc
