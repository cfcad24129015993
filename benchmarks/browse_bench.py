"""The browser's aggregate endpoints on a large store: how long each view's request takes.

    python -m benchmarks.browse_bench --rollouts 1000000 --json browse_bench.json

Writes a store of N synthetic rollouts (store_bench's shards: groups of 8, 256 tokens each, 4 models, 2 groups
per prompt and model at 2 policy steps) and one problems file with a text per prompt, starts a real store server
over it, and times every request a browser view makes for its aggregates (and /v1/stats beside them) over HTTP.
Prints one JSON object: per request p50 / p99 milliseconds and the store process's CPU milliseconds per call.
The machine it was written on is a 2-core VM shared with other jobs: the JSON carries the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from tqdm import tqdm

from benchmarks.store_bench import percentile
from benchmarks.store_data import MODELS, ShardMaker, bench_problem, bench_prompt_ids, plan_shards
from graft.schemas import Problem
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local import write_groups, write_problems


def write_store(root: Path, n_rollouts: int, seed: int) -> int:
    """Shards of every model, then the problems file; returns the number of prompts."""
    plan, prompts = plan_shards(n_rollouts, 8192)
    maker = ShardMaker(max(groups for _, _, groups in plan) * 8, seed)
    for model, first, groups in tqdm(plan, desc="shards", unit="shard"):
        write_groups(root, maker.shard(model, first, groups, prompts))
    write_problems(root, [Problem.from_text(bench_problem(i), str(2 * i + 7), "bench") for i in range(prompts)])
    return prompts


def time_requests(client: httpx.Client, store: psutil.Process, path: str, calls: int) -> dict[str, float]:
    client.get(path).raise_for_status()  # warm: the problem texts load on the first search
    cpu = store.cpu_times()
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        client.get(path).raise_for_status()
        took.append(1000 * (time.perf_counter() - started))
    after = store.cpu_times()
    store_ms = 1000 * ((after.user + after.system) - (cpu.user + cpu.system)) / calls
    return {"p50_ms": round(statistics.median(took), 2), "p99_ms": round(percentile(took, 99), 2),
            "store_cpu_ms_per_call": round(store_ms, 2), "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=30, help="requests timed per endpoint")
    parser.add_argument("--root", type=Path, default=None, help="store root (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="browse-bench-")) / "store"
    prompts = write_store(root, args.rollouts, args.seed) if not (root / "rollouts").exists() else None
    with StoreServer(root, startup_timeout_s=600) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        stats = client.get("/v1/stats").json()
        second_page = client.get("/v1/prompts", params={"limit": 50}).json()["next_cursor"]
        learner, peer = MODELS[0], MODELS[-1]
        one = bench_prompt_ids(101)[100]  # the 100th problem's prompt id
        grafted = client.get("/v1/prompts", params={"failed_by": learner, "solved_by": peer, "limit": 50}).json()
        requests = {
            "stats (existing)": "/v1/stats",
            "prompt list, first page of 50": "/v1/prompts?limit=50",
            "prompt list, second page": f"/v1/prompts?limit=50&cursor={second_page}",
            "prompt list, text search": "/v1/prompts?limit=50&q=what%20is%20123",
            "prompt list, id prefix": f"/v1/prompts?limit=50&q={one[:14]}",
            f"prompt list, failed by {learner} solved by {peer}": f"/v1/prompts?limit=50&failed_by={learner}&solved_by={peer}",
            f"prompt list, all-fail for {learner}": f"/v1/prompts?limit=50&outcome=all_fail&model={learner}",
            "one prompt": f"/v1/prompts/{one}",
            "success rate per policy step": "/v1/stats/steps",
            "datasets": "/v1/datasets",
        }
        store = psutil.Process(server.pid)
        load = os.getloadavg()[0]
        timings = {name: time_requests(client, store, path, args.calls) for name, path in tqdm(requests.items(), desc="requests")}
        result = {"rollouts": stats["total_rollouts"], "groups": stats["total_groups"], "prompts": prompts,
                  "grafted_prompts_on_first_page": len(grafted["prompts"]), "load_avg_1min": round(load, 1),
                  "store_rss_mb": round(store.memory_info().rss / 2**20), "requests": timings}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
