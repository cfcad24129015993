"""Several nodes: what GRAFT needs where verl's TaskRunner runs is checked there before verl starts a worker. A loopback
store URL is refused on a Ray cluster of two nodes (Ray's own multi-node cluster on this machine: two raylets), a
routable one that answers passes; a store that does not answer and a peer tokenizer directory that does not resolve
there fail naming the node, before verl's own set-up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer", reason="verl runs in its own environment: make install-verl, then .venv-verl/bin/python -m pytest")

from verl_world import graft_overrides, verl_config  # noqa: E402

from graft.integrations.verl.trainer import GraftPPOTrainer  # noqa: E402
from graft.services.store_api.http.testing import StoreServer  # noqa: E402

HERE = Path(__file__).parent


def routable_address() -> str | None:
    """The address Ray gives this machine for other nodes to reach it (None: loopback only)."""
    import ray.util

    address = ray.util.get_node_ip_address()
    return None if address.startswith("127.") else address


def test_a_loopback_store_url_is_refused_on_a_cluster_of_two_nodes(world):
    """verl's TaskRunner placed on the second node of a two-node Ray cluster: 127.0.0.1 is refused whether or not a
    store answers there; the store's routable address, which every node reaches, passes."""
    address = routable_address()
    if address is None:
        pytest.skip("this machine has no address but loopback: a second node could not reach a store")
    with StoreServer(world["store_root"], env={"GRAFT_STORE_HOST": "0.0.0.0"}) as store:  # every interface
        urls = [store.url, f"http://{address}:{store.port}"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        run = subprocess.run([sys.executable, str(HERE / "helpers" / "two_nodes.py"), *urls], env=env, cwd=HERE,
                             capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    loopback, routable = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert loopback["nodes"] == routable["nodes"] == 2
    assert loopback["error"].startswith("ValueError") and "loopback" in loopback["error"]
    assert f"node {socket.gethostname()}" in loopback["error"]
    assert routable["error"] is None


def trainer_of(world, store_url: str, peer_dir: Path, *extra: str) -> GraftPPOTrainer:
    return GraftPPOTrainer(verl_config(graft_overrides(world["learner_dir"], store_url, peer_dir) + list(extra)))


def test_a_store_that_does_not_answer_stops_the_set_up_before_verls(world):
    """`_setup` runs GRAFT's part first: a store that does not answer fails there, naming where it was asked from,
    before verl's own set-up (whose first need, the data files, is missing here too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    trainer = trainer_of(world, closed, world["peer_dir"], "data.train_files=/no/such/train.parquet",
                         "+graft.store_options.retries=0")
    with pytest.raises(RuntimeError, match=f"does not answer where verl's TaskRunner runs \\(node {socket.gethostname()}"):
        trainer._setup()


def test_a_peer_tokenizer_that_does_not_resolve_there_is_named_with_the_node(world, store, tmp_path):
    trainer = trainer_of(world, store.url, tmp_path / "no-such-peer", "data.train_files=/no/such/train.parquet")
    with pytest.raises(FileNotFoundError, match=f"no-such-peer does not exist.*node {socket.gethostname()}"):
        trainer._setup()
