"""Trajectory store benchmark: ingest, freshness, peer lookups over HTTP, the naive DuckDB scan, disk, peak RSS,
and the physical floor of a lookup on this machine. (One module of over 600 lines on purpose: each figure's setup, timing
and printed line read together in the order RESULTS.md reports them; the stores it measures are built by
benchmarks/store_data.py.)

    python -m benchmarks.store_bench --rollouts 1000000 --json store_bench.json
    python -m benchmarks.store_bench --profile reasoning --rollouts 1000000 --naive 3 --json store_reasoning.json
    python -m benchmarks.store_bench --backend lake --rollouts 200000 --json store_lake.json
    python -m benchmarks.store_bench --rollouts 1000000 --ledger 200000 --json store_ledger.json

`--ledger N` also fills the served ledger with N entries and times lookups with it and a cap beside lookups without
(`measure_ledger`: key `ledger`).

With `--backend lake` the same run then measures the DuckLake backend beside the local one: a PostgreSQL 15
catalog and moto's S3 server (a subprocess) on loopback, 4 writer processes committing the same synthetic
shards to the lake (one transaction each), 2 replicas (`graft-store serve --backend lake`) following it. Keys
`lake_*` and `replica_*`: commit rate, commit-to-servable time at a replica, replica lookups, replica RSS.

Builds a store of N synthetic rollouts (groups of 8; 4 models, each with 2 groups per prompt at 2 policy
steps) by writing shards through `write_groups` (the generators' path, vectorised validation and the lookup
file included) while a real store server indexes them, then measures against it. Two profiles of rollout
(`ShardMaker`): `short`, 256 tokens and 1 KB of text each, the store's figures since the first benchmark;
`reasoning`, a reasoning model's math answers, log-normal lengths around 1,500 tokens up to 8,192, ~3.2
bytes of real math text a token, logprobs that compress as real ones. Prints one JSON object; targets are in
the issues and in benchmarks/RESULTS.md. The ingest clock starts when the writer processes, forked and
holding their synthetic columns, are told to go (each then makes every shard's table, ~1 us/rollout, and
writes it) and stops when /v1/health counts every group: written, indexed and visible to lookups; ingest is
given in rollouts/s and in MB/s of the rows' Arrow bytes. Lookups give p50/p99 and the answer's MB/s (its
Arrow bytes over the p50); `page_cache_reference` reads the same numbers of bytes from a file in the page
cache and sends them over loopback TCP between two processes, no store in between (the machine's floor), and
`*_over_reference_rate` is the store's rate over that one. `disk_bytes` splits the store's disk into shards,
lookup files and index.

The machine it was written on is a 2-core VM shared with other jobs, so next to each wall-clock figure the
JSON gives the CPU time per operation (store process and this client process, from psutil / process_time
around the phase) and the 1-minute load average when each phase started (`load_avg`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import struct
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import psutil
from tqdm import tqdm

from benchmarks.store_data import (
    GROUP,
    MODELS,
    PROFILES,
    ShardMaker,
    bench_prompt_ids,
    plan_shards,
    reasoning_corpus,
)
from graft.schemas import MAX_WANTS, PeerLookupRequest, ServedRequest
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local import write_groups


def _writer(root: str, shards: list[tuple[str, int, int]], prompts: int, seed: int, max_rows: int, profile: str,
            done, go) -> None:
    maker = ShardMaker(max_rows, seed, profile)  # ~0.1-0.4 s of setup (short; ~6 s reasoning), before the clock starts
    bench_prompt_ids(prompts)
    done.put("ready")
    go.wait()
    user = system = 0.0  # CPU seconds inside write_groups: user space, and the kernel (page cache copies)
    for model, first, groups in shards:
        table = maker.shard(model, first, groups, prompts)
        before = os.times()
        write_groups(root, table)
        after = os.times()
        user += after.user - before.user
        system += after.system - before.system
        done.put((groups * GROUP, table.nbytes))
    done.put(("cpu", user, system))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def cpu_per_call(before: tuple[float, float], store_process: psutil.Process, calls: int) -> dict[str, float]:
    """CPU milliseconds per call in the store and in this client process (contention-free cost)."""
    return {"store": round((cpu_seconds(store_process) - before[0]) / calls * 1e3, 3),
            "client": round((time.process_time() - before[1]) / calls * 1e3, 3)}


def peak_rss_mb(pid: int) -> float:
    """The process's high-water resident set (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def measure_lookups(client: StoreClient, store_process: psutil.Process, rng: random.Random, prompts: int,
                    args: argparse.Namespace, phase) -> dict:
    """Single-prompt and 64-prompt peer lookups over HTTP (Arrow IPC, as the trainer's client does)."""
    result: dict = {}
    prompt_ids = bench_prompt_ids(prompts).tolist()

    def random_request(n_prompts: int) -> PeerLookupRequest:
        return PeerLookupRequest(prompt_ids=[prompt_ids[rng.randrange(prompts)] for _ in range(n_prompts)],
                                 learner_model=rng.choice(MODELS))

    def timed(name: str, n_prompts: int, calls: int) -> None:
        """`calls` lookups of `n_prompts` random prompts: p50/p99 ms, rows per call, CPU ms per call."""
        phase(name)
        times, returned, sizes = [], 0, []
        cpu_before = cpu_seconds(store_process), time.process_time()
        for _ in tqdm(range(calls), desc=f"lookup x{n_prompts}"):
            req = random_request(n_prompts)
            t = time.perf_counter()
            table, _ = client.lookup_peer_table(req)
            times.append(time.perf_counter() - t)
            returned += table.num_rows
            sizes.append(table.nbytes)
        result[f"{name}_p50_ms"] = round(percentile(times, 50) * 1e3, 3)
        result[f"{name}_p99_ms"] = round(percentile(times, 99) * 1e3, 3)
        result[f"{name}_rows_per_call"] = returned / calls
        result[f"{name}_cpu_ms"] = cpu_per_call(cpu_before, store_process, calls)
        # the answer's Arrow bytes (what the client receives, within the IPC framing) and the rate: the median
        # answer over the median time
        result[f"{name}_answer_mb"] = round(percentile(sizes, 50) / 1e6, 4)
        result[f"{name}_answer_mb_per_s"] = round(percentile(sizes, 50) / percentile(times, 50) / 1e6, 1)

    for _ in range(50):
        client.lookup_peer_table(random_request(1))
    timed("lookup", 1, args.lookups)
    with_models = []
    for _ in range(200):
        req = random_request(1)
        t = time.perf_counter()
        client.lookup_peer_groups(req)
        with_models.append(time.perf_counter() - t)
    result["lookup_as_models_p50_ms"] = round(percentile(with_models, 50) * 1e3, 3)
    timed("batch64", 64, args.batches)
    return result


def measure_ledger(client: StoreClient, rng: random.Random, prompts: int, args: argparse.Namespace, phase) -> dict:
    """The lookup with the served ledger and a cap against the lookup without, side by side (issue 50): the ledger
    first holds `args.ledger` entries of MODELS[0] over the groups of random prompts (1-3 entries a group, so that a
    cap of 2 skips about a third of the groups served); then `args.lookups` rounds of the same random single-prompt
    request under each policy (none; max_times_served 2; a cap no group reaches; the cap with order least_served), their
    order reversed every other round so that load drifts alike on all. p50/p99 ms each and the ratios to none."""
    phase("ledger_fill")
    prompt_ids = bench_prompt_ids(prompts).tolist()
    learner = MODELS[0]
    # the groups the learner can be served are the other models' (its own never come back): at most 80% of them
    reachable = sum(m.groups for m in client.stats().models if m.model_id != learner)
    groups: dict[str, None] = {}  # distinct, in the order found
    while len(groups) < min(args.ledger // 2, int(0.8 * reachable)):
        req = PeerLookupRequest(prompt_ids=[prompt_ids[rng.randrange(prompts)] for _ in range(64)], learner_model=learner,
                                informative_only=False, min_successes=0, groups_per_prompt=16)
        groups |= dict.fromkeys(client.lookup_peer_table(req)[0].column("group_id").to_pylist())
    entries = [g for g in groups for _ in range(rng.randint(1, 3))][: args.ledger]
    started = time.perf_counter()
    for begin in tqdm(range(0, len(entries), MAX_WANTS), desc="ledger"):
        client.record_served(ServedRequest(learner_model=learner, policy_step=begin // MAX_WANTS,
                                           group_ids=entries[begin:begin + MAX_WANTS]))
    fill_s = time.perf_counter() - started
    phase("ledger_lookups")
    # capped: a cap that skips what was served twice (fewer groups to read: cheaper); ledger_read: a cap no group
    # reaches, so that the lookup reads the ledger for every group and skips none (the ledger's cost alone)
    policies = {"plain": {}, "capped": {"max_times_served": 2}, "ledger_read": {"max_times_served": 1000},
                "capped_least_served": {"max_times_served": 2, "order": "least_served"}}
    times: dict[str, list[float]] = {name: [] for name in policies}
    returned = dict.fromkeys(policies, 0)
    for call in tqdm(range(args.lookups + 50), desc="ledger lookups"):
        prompt = [prompt_ids[rng.randrange(prompts)]]
        names = list(policies) if call % 2 == 0 else list(reversed(policies))
        for name in names:
            req = PeerLookupRequest(prompt_ids=prompt, learner_model=learner, groups_per_prompt=4, **policies[name])
            t = time.perf_counter()
            table, _ = client.lookup_peer_table(req)
            if call >= 50:  # the first 50: warm-up
                times[name].append(time.perf_counter() - t)
                returned[name] += table.num_rows
    result = {"entries": len(entries), "groups": len(dict.fromkeys(entries)), "fill_entries_per_s": round(len(entries) / fill_s),
              "calls": args.lookups, "ledger_entries_in_store": client.stats().broker.ledger_entries}
    for name in policies:
        result[f"{name}_p50_ms"] = round(percentile(times[name], 50) * 1e3, 3)
        result[f"{name}_p99_ms"] = round(percentile(times[name], 99) * 1e3, 3)
        result[f"{name}_rows_per_call"] = returned[name] / args.lookups
    for name in ("capped", "ledger_read", "capped_least_served"):
        for q in ("p50", "p99"):
            result[f"{name}_over_plain_{q}"] = round(result[f"{name}_{q}_ms"] / result[f"plain_{q}_ms"], 3)
    return result


def _reference_server(path: str, listener: socket.socket) -> None:
    """Answer (length, offset) requests with that many bytes of `path`, read with pread: a lookup's physical floor."""
    fd = os.open(path, os.O_RDONLY)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while request := conn.recv(16, socket.MSG_WAITALL):
                length, offset = struct.unpack("<qq", request)
                conn.sendall(os.pread(fd, length, offset))


def page_cache_reference(root: Path, sizes: dict[str, int], calls: int) -> dict:
    """Read `size` bytes at random offsets of a file in the page cache and send them over loopback TCP to this
    process (another process reads and sends, as the store does; this one receives into a buffer): p50 ms and
    MB/s of each size, timed from the request to the last byte."""
    path = root / "page-cache-reference.bin"
    span = max(64 << 20, 4 * max(sizes.values()))
    with open(path, "wb") as f:
        for _ in range(span >> 20):
            f.write(os.urandom(1 << 20))
    path.read_bytes()  # into the page cache
    listener = socket.create_server(("127.0.0.1", 0))
    server = multiprocessing.get_context("fork").Process(target=_reference_server, args=(str(path), listener),
                                                         daemon=True)
    server.start()
    result = {}
    rng = np.random.default_rng(0)
    try:
        with socket.create_connection(listener.getsockname()) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for name, size in sizes.items():
                buffer = memoryview(bytearray(size))
                times = []
                for _ in range(calls):
                    offset = int(rng.integers(0, span - size))
                    t = time.perf_counter()
                    conn.sendall(struct.pack("<qq", size, offset))
                    received = 0
                    while received < size:
                        received += conn.recv_into(buffer[received:])
                    times.append(time.perf_counter() - t)
                p50 = percentile(times, 50)
                result[name] = {"bytes": size, "p50_ms": round(p50 * 1e3, 3), "mb_per_s": round(size / p50 / 1e6, 1)}
    finally:
        server.kill()
        listener.close()
        path.unlink()
    return result


def disk_by_part(root: Path) -> dict[str, int]:
    """Bytes on disk of the store's shards, lookup files (any version's) and index (DuckDB file, WAL, manifest)."""
    def total(paths) -> int:
        return sum(p.stat().st_size for p in paths if p.is_file())

    return {"shards": total((root / "rollouts").rglob("*.parquet")), "lookup_files": total((root / "lookup").rglob("*")),
            "index": total([*root.glob("index.duckdb*"), root / "manifest.json"])}


def naive_lookup(con: duckdb.DuckDBPyConnection, glob: str, prompt: str, learner: str) -> list[dict]:
    """The same single-prompt lookup without the index: scan the shards with read_parquet and a WHERE."""
    rows = con.sql(
        f"SELECT * FROM read_parquet('{glob}') WHERE prompt_id = ? AND model_id <> ?", params=[prompt, learner]
    ).to_arrow_table().to_pylist()
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
    informative = [g for g in groups.values() if 0 < sum(r["correct"] for r in g) < len(g)]
    informative.sort(key=lambda g: (-g[0]["policy_step"], -max(r["created_at"] for r in g).timestamp()))
    return informative[:1]


# ------------------------------------------------------------------------------------------ the lake backend


def _lake_writer(lake_env: dict, shards: list[tuple[str, int, int]], prompts: int, seed: int, max_rows: int,
                 profile: str, done, go) -> None:
    """A writer process committing each synthetic shard to the lake in one transaction (validated first, as
    graft-generate and write_groups do)."""
    from graft.services.store_api.lake import Lake, LakeConfig
    from graft.services.store_api.tables import validate_table

    os.environ.update(lake_env)
    maker = ShardMaker(max_rows, seed, profile)
    lake = Lake(LakeConfig()).open()  # extensions loaded and the lake attached before the clock starts
    done.put("ready")
    go.wait()
    before = os.times()
    for model, first, groups in shards:
        lake.writing.commit(validate_table(maker.shard(model, first, groups, prompts)))
        done.put(groups * GROUP)
    after = os.times()
    lake.close()
    done.put(("cpu", after.user - before.user, after.system - before.system))


def measure_lake(args: argparse.Namespace, phase) -> dict:
    """The lake backend on the same synthetic data: commit rate of `--lake-writers` processes, commit-to-servable
    time at a replica, lookups at a replica (the local figures' method), replica RSS."""
    from graft.services.store_api.lake import Lake, LakeConfig
    from graft.services.store_api.tables import validate_table
    from testbed.lake_services import S3_KEY_ID, S3_SECRET, MotoS3, PostgresServer

    result: dict = {}
    plan, prompts = plan_shards(args.rollouts, args.shard_rollouts)
    n_rollouts = sum(g for _, _, g in plan) * GROUP
    work = Path(tempfile.mkdtemp(prefix="store-bench-lake-"))
    postgres = PostgresServer().start()
    s3 = MotoS3(in_process=False).start()  # its own process: its request handling does not share our GIL
    replicas: list[StoreServer] = []
    try:
        config = LakeConfig(catalog=f"ducklake:postgres:{postgres.create_database('bench')}",
                            data_path=f"s3://{s3.bucket}/bench/", s3_endpoint=s3.endpoint, s3_key_id=S3_KEY_ID,
                            s3_secret=S3_SECRET)
        Lake(config).open().close()
        lake_env = config.env()
        replica_env = {k: v for k, v in lake_env.items() if k != "GRAFT_LAKE_CATALOG"} | {
            "GRAFT_STORE_BACKEND": "lake", "GRAFT_STORE_LAKE_CATALOG": config.catalog,
            "GRAFT_STORE_COMPACT_INTERVAL_S": "0", "GRAFT_STORE_LOG_LEVEL": "warning"}
        replicas = [StoreServer(work / f"replica-{r}", env=replica_env).start() for r in range(args.replicas)]
        clients = [StoreClient(r.url, timeout_s=60) for r in replicas]

        # ---- ingest: writer processes commit shards to the lake; the replicas follow
        context = multiprocessing.get_context("fork")
        done, go = context.Queue(), context.Event()
        writers = [context.Process(target=_lake_writer, args=(lake_env, plan[w::args.lake_writers], prompts,
                                                              args.seed + w, args.shard_rollouts, args.profile,
                                                              done, go))
                   for w in range(args.lake_writers)]
        for w in writers:
            w.start()
        for _ in writers:
            if done.get(timeout=300) != "ready":
                raise RuntimeError("a lake writer sent a result before it was ready")
        phase("lake_ingest")
        services = {"s3": psutil.Process(s3.pid)} | {f"replica-{r}": psutil.Process(p.pid) for r, p in enumerate(replicas)}
        cpu_before = {name: cpu_seconds(process) for name, process in services.items()}
        started = time.perf_counter()
        go.set()
        finished, writer_cpu = 0, 0.0
        with tqdm(total=n_rollouts, desc="lake commit", unit="rollout", unit_scale=True) as bar:
            while finished < len(writers):
                item = done.get()
                if isinstance(item, tuple):
                    finished += 1
                    writer_cpu += item[1] + item[2]
                else:
                    bar.update(item)
        committed = time.perf_counter()
        s3_cpu_commit = cpu_seconds(services["s3"]) - cpu_before["s3"]
        for w in writers:
            w.join()
            if w.exitcode:
                raise RuntimeError(f"lake writer exited with {w.exitcode}")
        with tqdm(total=n_rollouts * len(clients), desc="replicas", unit="rollout", unit_scale=True) as bar:
            while (served := sum(c.health().groups for c in clients) * GROUP) < n_rollouts * len(clients):
                bar.n = served
                bar.refresh()
                time.sleep(0.05)
        servable = time.perf_counter()
        cpu = {name: cpu_seconds(process) - cpu_before[name] for name, process in services.items()}
        replica_cpu = [cpu[f"replica-{r}"] for r in range(len(replicas))]
        # CPU per rollout (this 2-core machine is shared): the writers' processes, moto's server for the uploads
        # (and, by the time the replicas caught up, their downloads), each replica following the lake
        result["lake_cpu_us_per_rollout"] = {
            "writers": round(writer_cpu / n_rollouts * 1e6, 1),
            "s3_server_commit": round(s3_cpu_commit / n_rollouts * 1e6, 1),
            "s3_server_total": round(cpu["s3"] / n_rollouts * 1e6, 1),
            "each_replica": round(statistics.mean(replica_cpu) / n_rollouts * 1e6, 1)}
        result["lake_ingest_rollouts_per_s_cpu_bound_2_cores"] = round(2 * n_rollouts / (writer_cpu + s3_cpu_commit))
        result["lake_ingest_rollouts_per_s"] = round(n_rollouts / (committed - started))
        result["lake_replicas_caught_up_s"] = round(servable - committed, 2)
        result["lake_ingest_to_servable_rollouts_per_s"] = round(n_rollouts / (servable - started))
        with Lake(config, create=False) as lake:
            result["lake_data_files"] = lake.reading.counts()["files"]
        pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix="bench/")
        result["lake_bytes_in_bucket"] = sum(o["Size"] for page in pages for o in page.get("Contents", []))

        # ---- freshness: a commit lands, how long until a replica's lookup returns it
        maker = ShardMaker(GROUP, args.seed + 99)
        phase("lake_freshness")
        delays = []
        with Lake(config) as lake:
            for trial in range(7):
                table = validate_table(maker.shard("fresh-model", prompts + trial, 1, prompts + 100))
                req = PeerLookupRequest(prompt_ids=[table.column("prompt_id")[0].as_py()], learner_model="nobody",
                                        informative_only=False, min_successes=0)
                lake.writing.commit(table)
                landed = time.perf_counter()
                while clients[0].lookup_peer_table(req)[0].num_rows == 0:
                    time.sleep(0.002)
                delays.append(time.perf_counter() - landed)
        result["lake_freshness_s"] = round(statistics.median(delays), 3)
        result["lake_freshness_max_s"] = round(max(delays), 3)

        # ---- lookups at a replica, as for the local store
        rng = random.Random(args.seed + 1)
        prompt_ids = bench_prompt_ids(prompts).tolist()
        replica_result = measure_lookups(clients[0], psutil.Process(replicas[0].pid), rng, prompts, args,
                                         lambda name: phase("replica_" + name))
        result |= {"replica_" + key: value for key, value in replica_result.items()}
        # the replicas answer the same lookups identically once both read the newest snapshot
        newest = max(c.stats().lake.newest_snapshot_id for c in clients)
        while min(c.stats().lake.snapshot_id for c in clients) < newest:
            time.sleep(0.05)
        for _ in range(50):
            req = PeerLookupRequest(prompt_ids=[prompt_ids[rng.randrange(prompts)] for _ in range(16)],
                                    learner_model=rng.choice(MODELS))
            answers = [c.lookup_peer_table(req)[0] for c in clients]
            if not all(a.equals(answers[0]) for a in answers[1:]):
                raise AssertionError(f"replicas answered {req} differently")
        result["replicas_identical_answers"] = True
        result["replica_peak_rss_mb"] = round(max(peak_rss_mb(r.pid) for r in replicas), 1)
        disk = result["replica_disk_bytes"] = disk_by_part(work / "replica-0")  # its cache: shards, lookup files
        result["replica_disk_over_shards"] = round(sum(disk.values()) / disk["shards"], 3)
        for client in clients:
            client.close()
    finally:
        for replica in replicas:
            replica.stop()
        s3.stop()
        postgres.close()
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=100_000, help="rollouts to store")
    parser.add_argument("--profile", choices=PROFILES, default="short",
                        help="short: 256 tokens and 1 KB of text a rollout; reasoning: a reasoning model's lengths")
    parser.add_argument("--codec", default=None,
                        help="the bulk columns' codec of the shards the writers write (default: the store's own)")
    parser.add_argument("--reference-calls", type=int, default=200, help="page-cache read-and-send calls per size")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON result here")
    parser.add_argument("--root", type=Path, default=None, help="store root (default: a temporary directory, removed)")
    parser.add_argument("--shard-rollouts", type=int, default=8192, help="rollouts per shard")
    parser.add_argument("--writers", type=int, default=2, help="writer processes")
    parser.add_argument("--lookups", type=int, default=2000, help="single-prompt lookups to time")
    parser.add_argument("--batches", type=int, default=200, help="64-prompt lookups to time")
    parser.add_argument("--naive", type=int, default=20, help="naive DuckDB lookups to time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["local", "lake"], default="local",
                        help="lake: also measure the DuckLake backend (PostgreSQL + moto on loopback) in the same run")
    parser.add_argument("--lake-writers", type=int, default=4, help="writer processes committing to the lake")
    parser.add_argument("--replicas", type=int, default=2, help="lake replicas following the lake")
    parser.add_argument("--ledger", type=int, default=0, help="served ledger entries to fill, then time lookups with "
                        "the ledger and a cap beside lookups without (issue 50); 0: not measured")
    args = parser.parse_args()

    root = args.root or Path(tempfile.mkdtemp(prefix="store-bench-")) / "store"
    if root.exists():
        shutil.rmtree(root)
    plan, prompts = plan_shards(args.rollouts, args.shard_rollouts)
    n_rollouts = sum(g for _, _, g in plan) * GROUP
    rng = random.Random(args.seed)
    result: dict = {"rollouts": n_rollouts, "profile": args.profile, "shards": len(plan), "prompts": prompts,
                    "models": len(MODELS), "cpus": os.cpu_count(), "load_avg_before": os.getloadavg()[0]}
    if args.codec:  # the writers fork from this process and write with its module state
        from graft.services.store_api.local import shards

        if not hasattr(shards, "BULK_CODEC"):
            raise SystemExit("--codec: this store's shards have no BULK_CODEC to set")
        shards.BULK_CODEC = args.codec
    from graft.services.store_api.local import shards as shard_module

    result["bulk_codec"] = getattr(shard_module, "BULK_CODEC", "zstd")
    if args.profile == "reasoning":
        reasoning_corpus()  # once, before the writers fork
    load = result["load_avg"] = {}  # 1-minute load average as each phase starts

    def phase(name: str) -> None:
        load[name] = round(os.getloadavg()[0], 2)

    server = StoreServer(root, env={"GRAFT_STORE_COMPACT_INTERVAL_S": "0", "GRAFT_STORE_LOG_LEVEL": "warning"}).start()
    try:
        client = StoreClient(server.url, timeout_s=60)

        # ---- ingest: writer processes write shards, the store indexes them as they land
        context = multiprocessing.get_context("fork")
        done, go = context.Queue(), context.Event()
        writers = [context.Process(target=_writer, args=(str(root), plan[w::args.writers], prompts, args.seed + w,
                                                         args.shard_rollouts, args.profile, done, go))
                   for w in range(args.writers)]
        store_process = psutil.Process(server.pid)
        for w in writers:
            w.start()
        for _ in writers:  # each writer has drawn its synthetic data: the clock starts with their first shard
            if done.get(timeout=300) != "ready":  # queue.Empty if a writer died while drawing its data
                raise RuntimeError("a writer sent a result before it was ready")
        phase("ingest")
        store_cpu = cpu_seconds(store_process)
        started = time.perf_counter()
        go.set()
        finished, writer_user, writer_system, raw_bytes = 0, 0.0, 0.0, 0
        with tqdm(total=n_rollouts, desc="write", unit="rollout", unit_scale=True) as bar:
            while finished < len(writers):
                item = done.get()
                if item[0] == "cpu":
                    finished += 1
                    writer_user += item[1]
                    writer_system += item[2]
                else:
                    bar.update(item[0])
                    raw_bytes += item[1]
        for w in writers:
            w.join()
            if w.exitcode:
                raise RuntimeError(f"writer exited with {w.exitcode}")
        written = time.perf_counter()
        # poll /v1/health (a counter), not /v1/stats (DuckDB aggregates): polling must not cost the store CPU
        with tqdm(total=n_rollouts, desc="index", unit="rollout", unit_scale=True) as bar:
            while (indexed := client.health().groups * GROUP) < n_rollouts:
                bar.n = indexed
                bar.refresh()
                time.sleep(0.05)
            bar.n = indexed
            bar.refresh()
        ingested = time.perf_counter()
        index_cpu = cpu_seconds(store_process) - store_cpu
        result["write_rollouts_per_s"] = round(n_rollouts / (written - started))
        result["ingest_rollouts_per_s"] = round(n_rollouts / (ingested - started))
        # the rows' Arrow bytes (text, token ids, logprobs and the rest, as the writers hold them) per second
        result["raw_bytes_per_rollout"] = round(raw_bytes / n_rollouts)
        result["ingest_mb_per_s"] = round(raw_bytes / (ingested - started) / 1e6, 1)
        # CPU seconds spent writing (validation + Parquet, in the writers) and indexing (in the store): what
        # the wall-clock rate would be on idle cores, since this 2-core machine is shared with other jobs
        writer_cpu = writer_user + writer_system
        result["ingest_cpu_s_per_100k_rollouts"] = {"write": round(writer_cpu / n_rollouts * 1e5, 2),
                                                    "write_kernel": round(writer_system / n_rollouts * 1e5, 2),
                                                    "index": round(index_cpu / n_rollouts * 1e5, 2)}
        # the same in microseconds per rollout; the writers' kernel share is mostly page cache work (copies, allocation)
        result["ingest_cpu_us_per_rollout"] = {
            "write_user": round(writer_user / n_rollouts * 1e6, 1),
            "write_kernel": round(writer_system / n_rollouts * 1e6, 1),
            "index": round(index_cpu / n_rollouts * 1e6, 1),
            "total": round((writer_cpu + index_cpu) / n_rollouts * 1e6, 1),
        }
        # the rate the CPU time allows: all of write + index, on 2 cores kept busy by this job alone
        result["ingest_rollouts_per_s_cpu_bound_2_cores"] = round(2 * n_rollouts / (writer_cpu + index_cpu))
        disk = result["disk_bytes"] = disk_by_part(root)
        result["store_bytes_on_disk"] = disk["shards"]
        result["lookup_file_bytes_on_disk"] = disk["lookup_files"]
        result["disk_over_shards"] = round(sum(disk.values()) / disk["shards"], 3)
        result["disk_bytes_per_rollout"] = {part: round(size / n_rollouts) for part, size in disk.items()}

        # ---- freshness: a shard lands, how long until a lookup returns it
        maker = ShardMaker(GROUP, args.seed + 99)
        phase("freshness")
        delays = []
        for trial in range(7):
            table = maker.shard("fresh-model", prompts + trial, 1, prompts + 100)
            write_groups(root, table)
            landed = time.perf_counter()
            req = PeerLookupRequest(prompt_ids=[table.column("prompt_id")[0].as_py()], learner_model="nobody",
                                    informative_only=False, min_successes=0)
            while client.lookup_peer_table(req)[0].num_rows == 0:
                time.sleep(0.002)
            delays.append(time.perf_counter() - landed)
        result["freshness_s"] = round(statistics.median(delays), 3)
        result["freshness_max_s"] = round(max(delays), 3)

        # ---- peer lookups over HTTP (Arrow IPC, as the trainer's client does)
        result |= measure_lookups(client, store_process, rng, prompts, args, phase)
        if args.ledger:
            result["ledger"] = measure_ledger(client, rng, prompts, args, phase)

        # ---- the naive way: DuckDB read_parquet over the shard glob with a WHERE (in-process, no HTTP)
        con = duckdb.connect()
        glob = str(root / "rollouts" / "model=*" / "part-*.parquet")
        prompt_ids = bench_prompt_ids(prompts).tolist()
        naive_lookup(con, glob, prompt_ids[0], MODELS[0])
        phase("naive")
        naive = []
        for _ in tqdm(range(args.naive), desc="naive"):
            prompt, learner = prompt_ids[rng.randrange(prompts)], rng.choice(MODELS)
            t = time.perf_counter()
            found = naive_lookup(con, glob, prompt, learner)
            naive.append(time.perf_counter() - t)
            assert found, f"naive lookup found nothing for {prompt}"
        result["naive_p50_ms"] = round(percentile(naive, 50) * 1e3, 3)
        result["speedup_vs_naive"] = round(result["naive_p50_ms"] / result["lookup_p50_ms"], 1)
        result["peak_rss_mb"] = round(peak_rss_mb(server.pid), 1)

        # ---- the physical reference: the same bytes as each lookup's median answer, read from the page cache
        # and sent over loopback, no store in between
        phase("reference")
        reference = page_cache_reference(root, {name: max(1, int(result[f"{name}_answer_mb"] * 1e6))
                                                for name in ("lookup", "batch64")}, args.reference_calls)
        result["page_cache_reference"] = reference
        for name in ("lookup", "batch64"):
            result[f"{name}_over_reference_rate"] = round(
                result[f"{name}_answer_mb_per_s"] / reference[name]["mb_per_s"], 3)
        result["load_avg_after"] = os.getloadavg()[0]
        client.close()
    finally:
        server.stop()
        if args.root is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    if args.backend == "lake":
        result |= measure_lake(args, phase)
        result["load_avg_after_lake"] = os.getloadavg()[0]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
