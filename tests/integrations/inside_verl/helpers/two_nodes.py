"""TEST-ONLY: a Ray cluster of two nodes on this machine (Ray's own `ray.cluster_utils.Cluster`: a head and a second
raylet), with GRAFT's preflight run in a Ray actor placed on the second node, as verl's TaskRunner runs it wherever Ray
places it.

`python two_nodes.py URL...`: one JSON line per store URL, {"url": URL, "nodes": N, "error": "Type: message" | null}."""

from __future__ import annotations

import json
import sys


def main(urls: list[str]) -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    second = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()

    @ray.remote(num_cpus=0)
    class TaskRunner:
        def preflight(self, url: str) -> tuple[int, str | None]:
            from graft.integrations.verl.preflight import preflight, ray_nodes
            from graft.trainer import StoreConfig

            try:
                preflight(StoreConfig(url=url, timeout_s=5.0, retries=0))
            except Exception as exc:  # reported to the test, which checks which
                return ray_nodes(), f"{type(exc).__name__}: {exc}"
            return ray_nodes(), None

    runner = TaskRunner.options(scheduling_strategy=NodeAffinitySchedulingStrategy(second.node_id, soft=False)).remote()
    try:
        for url in urls:
            nodes, error = ray.get(runner.preflight.remote(url), timeout=120)
            print(json.dumps({"url": url, "nodes": nodes, "error": error}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
