"""CPU per rollout of each part of the lake backend alone: a writer's commits, moto's S3 server taking them, a
replica catching up with the lake (reading it and writing its cache). The figures `store_bench --backend lake`
gives are of all of them at once on a shared machine; these say which part costs what.

    python -m benchmarks.lake_profile --rollouts 65536 [--profile DIR]

PostgreSQL and moto on loopback, as in store_bench. One process commits the synthetic shards of store_bench
(8192 rollouts each, validated before the clock) one after the other, then a replica (`LakeReplica`, in this
process, the server's class) reads the whole lake into a fresh cache. CPU is the process's (os.times, user and
kernel) and moto's (psutil); `--profile DIR` also writes cProfile files of both parts (writer.prof,
replica.prof) for `python -m pstats`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.store_bench import cpu_seconds
from benchmarks.store_data import GROUP, ShardMaker, plan_shards
from graft.services.store_api.lake import Lake, LakeConfig
from graft.services.store_api.lake.replica import LakeReplica
from graft.services.store_api.settings import StoreSettings
from graft.services.store_api.tables import validate_table
from testbed.lake_services import S3_KEY_ID, S3_SECRET, MotoS3, PostgresServer


def timed(work, rollouts: int, s3: psutil.Process, profile: Path | None) -> dict:
    """Run `work()`; CPU microseconds per rollout of this process (user, kernel) and of the S3 server."""
    profiler = cProfile.Profile() if profile else None
    s3_before, before, started = cpu_seconds(s3), os.times(), time.perf_counter()
    if profiler:
        profiler.enable()
    work()
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile)
    after, wall = os.times(), time.perf_counter() - started
    user, kernel = after.user - before.user, after.system - before.system
    return {"cpu_us_per_rollout": round((user + kernel) / rollouts * 1e6, 1),
            "user_us": round(user / rollouts * 1e6, 1), "kernel_us": round(kernel / rollouts * 1e6, 1),
            "s3_server_us": round((cpu_seconds(s3) - s3_before) / rollouts * 1e6, 1),
            "wall_us": round(wall / rollouts * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=65536, help="rollouts to commit (8192 per commit)")
    parser.add_argument("--profile", type=Path, default=None, help="write writer.prof and replica.prof here")
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    plan, prompts = plan_shards(args.rollouts, 8192)
    maker = ShardMaker(8192, 0)
    tables = [validate_table(maker.shard(model, first, groups, prompts)) for model, first, groups in plan]
    rollouts = sum(t.num_rows for t in tables)
    result: dict = {"rollouts": rollouts, "commits": len(tables), "load_avg_before": os.getloadavg()[0]}
    postgres = PostgresServer().start()
    s3 = MotoS3(in_process=False).start()
    cache = Path(tempfile.mkdtemp(prefix="lake-profile-"))
    try:
        config = LakeConfig(catalog=f"ducklake:postgres:{postgres.create_database('profile')}",
                            data_path=f"s3://{s3.bucket}/profile/", s3_endpoint=s3.endpoint, s3_key_id=S3_KEY_ID,
                            s3_secret=S3_SECRET)
        s3_process = psutil.Process(s3.pid)
        with Lake(config) as lake:  # attached (extensions loaded) before the clock
            result["writer"] = timed(lambda: [lake.writing.commit(table) for table in tables], rollouts, s3_process,
                                     args.profile and args.profile / "writer.prof")
        os.environ.update({k: v for k, v in config.env().items() if k != "GRAFT_LAKE_CATALOG"})
        replica = LakeReplica(StoreSettings(root=cache, backend="lake", lake_catalog=config.catalog,
                                            compact_interval_s=0))
        result["replica_catch_up"] = timed(replica.open, rollouts, s3_process,
                                           args.profile and args.profile / "replica.prof")
        cached = len(replica.index.catalog.mirror) * GROUP
        if cached != rollouts:
            raise AssertionError(f"the replica cached {cached} of {rollouts} rollouts")
        replica.close()
    finally:
        s3.stop()
        postgres.close()
        shutil.rmtree(cache, ignore_errors=True)
    result["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
