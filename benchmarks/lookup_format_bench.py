"""What each way of keeping lookup data costs: disk, write CPU, and the CPU of a lookup's read (no HTTP).

    python -m benchmarks.lookup_format_bench --json lookup_formats.json

One shard of synthetic rollouts per profile (`store_bench.ShardMaker`: `short`, 256 tokens and 1 KB of text;
`reasoning`, log-normal lengths around 1,500 tokens of real math text), written each way:

- `copies`: main's layout before issue 39: the shard's pages cut by size (1 MB), and a lookup file holding an
  uncompressed Arrow IPC copy of every group (`write_lookup_file` without pages);
- `ipc-lz4`, `ipc-zstd`: the same copies with Arrow IPC buffer compression (pyarrow compresses each buffer of
  each group's message; the client's IPC reader decompresses);
- `pages-<codec>`: shards whose data pages hold whole groups (`shards.encode_shard`) with the bulk columns in
  that codec, and lookup files of templates (`local/lookup/`): a lookup reads the group's pages from the shard;
  `pages-lz4_raw-every-column`: the same from one pyarrow file, so every column's pages hold whole groups.

Also what reading the shard costs outside the store: DuckDB aggregating three small columns, and DuckDB's naive
single-prompt lookup (`SELECT *` with a WHERE on prompt_id), the least wall time of 5 each.

Per way: bytes per rollout of shard and lookup file and their ratio, CPU microseconds per rollout to write
the shard (to its file, as the store does: the least of 3 writes) and the lookup file (the page walk included),
and, with the files in the page cache, the CPU milliseconds a lookup of 1 and of 64 random groups takes to
produce its answer (`ShardReader.messages` and the join into a stream: what the store does) and to decode it
(`read_stream`: what the client does), the median of `--lookups` calls. CPU time (user + kernel of this one
process) is inflated less than wall time by other jobs on the machine; the 1-minute load average is printed
beside each way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.store_data import GROUP, ShardMaker
from graft.schemas import ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local import shards
from graft.services.store_api.local.lookup import (
    ShardReader,
    arrow_stream,
    lookup_path,
    read_stream,
    shard_footer,
    table_groups,
    write_lookup_file,
)
from graft.services.store_api.local.pages import bulk_pages
from graft.services.store_api.tables import BULK_COLUMNS, group_runs, validate_table


def _copies_shard(table: pa.Table, lengths, path: str) -> None:
    """The shard as main wrote it before issue 39: pages cut at pyarrow's default 1 MB, version 1."""
    compression = {(f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name):
                   ("zstd" if f.name in BULK_COLUMNS else "none") for f in ROLLOUT_ARROW_SCHEMA}
    with pq.ParquetWriter(path, ROLLOUT_ARROW_SCHEMA, compression=compression, use_dictionary=False,
                          write_statistics=shards.STATISTICS_COLUMNS, write_page_checksum=True) as writer:
        offset = 0
        for rows in shards.row_group_plan(lengths, shards.ROW_GROUP_ROWS):
            writer.write_table(table.slice(offset, rows), row_group_size=rows)
            offset += rows


def _one_file_shard(table: pa.Table, lengths, path: str) -> None:
    """Pages of whole groups for every column: one pyarrow file with `max_rows_per_page` (what `encode_shard` does
    before it splices the small columns' pages back to pyarrow's own)."""
    compression = {(f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name):
                   ("lz4" if f.name in BULK_COLUMNS else "none") for f in ROLLOUT_ARROW_SCHEMA}
    with pq.ParquetWriter(path, ROLLOUT_ARROW_SCHEMA, compression=compression, use_dictionary=False,
                          write_statistics=shards.STATISTICS_COLUMNS, write_page_checksum=True,
                          data_page_version="2.0", data_page_size=shards.PAGE_BYTES_MAX,
                          max_rows_per_page=math.gcd(*lengths.tolist()),
                          column_encoding={"completion_text": "DELTA_LENGTH_BYTE_ARRAY"}) as writer:
        offset = 0
        for rows in shards.row_group_plan(lengths, shards.ROW_GROUP_ROWS):
            writer.write_table(table.slice(offset, rows), row_group_size=rows)
            offset += rows


def _encode(table: pa.Table, lengths, way: str, path: str) -> None:
    if way == "pages-lz4_raw-every-column":
        _one_file_shard(table, lengths, path)
        return
    if not way.startswith("pages-"):
        _copies_shard(table, lengths, path)
        return
    saved = shards.BULK_CODEC
    shards.BULK_CODEC = way.removeprefix("pages-")
    try:
        shards.encode_shard(table, lengths, path)
    finally:
        shards.BULK_CODEC = saved


def _cpu(work) -> float:
    before = time.process_time()
    work()
    return time.process_time() - before


def _write(root: Path, table: pa.Table, way: str) -> dict:
    """Write the shard (the least CPU of 3 writes: one core shared with other jobs) and its lookup file `way`;
    bytes and CPU per rollout."""
    starts, lengths = group_runs(table.column("group_id"))
    shard = root / "rollouts" / "model=model-a" / "part-bench.parquet"
    shard.parent.mkdir(parents=True, exist_ok=True)
    n = table.num_rows
    encode = min(_cpu(lambda: _encode(table, lengths, way, str(shard))) for _ in range(3))
    before = time.process_time()
    if way.startswith("pages-"):
        with pa.memory_map(str(shard)) as source:
            pages = bulk_pages(source, pq.ParquetFile(source).metadata)
        write_lookup_file(lookup_path(shard), [(0, table)], shard_footer(shard), pages)
        lookup_bytes = lookup_path(shard).stat().st_size
    elif way == "copies":
        write_lookup_file(lookup_path(shard), [(0, table)], shard_footer(shard))
        lookup_bytes = lookup_path(shard).stat().st_size
    else:  # a compressed IPC message per group: what a lookup file of them would hold
        options = pa.ipc.IpcWriteOptions(compression=way.removeprefix("ipc-"))
        lookup_bytes = 0
        for _, group in table_groups(table, starts, lengths):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, ROLLOUT_ARROW_SCHEMA, options=options) as writer:
                writer.write_batch(group)
            lookup_bytes += sink.tell() - len(ROLLOUT_ARROW_SCHEMA.serialize()) - 8
    written = time.process_time()
    size = shard.stat().st_size
    return {"shard_bytes_per_rollout": round(size / n), "lookup_bytes_per_rollout": round(lookup_bytes / n),
            "total_over_shard": round((size + lookup_bytes) / size, 3),
            "encode_shard_us_per_rollout": round(encode / n * 1e6, 1),
            "lookup_file_us_per_rollout": round((written - before) / n * 1e6, 1)}


def _scans(root: Path, table: pa.Table) -> dict:
    """What reading the shard costs outside the store: DuckDB's aggregate of small columns over it, and its
    naive single-prompt lookup (`SELECT *` with a WHERE), the least wall ms of 5."""
    import duckdb

    path = root / "rollouts" / "model=model-a" / "part-bench.parquet"
    prompt = table.column("prompt_id")[0].as_py()
    queries = {"duckdb_small_columns_ms": f"SELECT count(*), avg(reward), sum(num_tokens) FROM read_parquet('{path}')",
               "duckdb_naive_ms": f"SELECT * FROM read_parquet('{path}') WHERE prompt_id = '{prompt}'"}
    con = duckdb.connect()
    result = {}
    for name, sql in queries.items():
        times = []
        for _ in range(5):
            t = time.perf_counter()
            con.sql(sql).to_arrow_table()
            times.append(time.perf_counter() - t)
        result[name] = round(min(times) * 1e3, 2)
    return result


def _lookups(root: Path, table: pa.Table, way: str, calls: int, rng: random.Random) -> dict:
    """Median ms of producing (store) and decoding (client) the answer to lookups of 1 and 64 random groups."""
    starts, lengths = group_runs(table.column("group_id"))
    groups = list(zip(starts.tolist(), lengths.tolist()))
    rel = "rollouts/model=model-a/part-bench.parquet"
    result = {}
    if way.startswith("ipc-"):
        options = pa.ipc.IpcWriteOptions(compression=way.removeprefix("ipc-"))
        batches = [g for _, g in table_groups(table, starts, lengths)]
        for k in (1, 64):
            produce, decode, size = [], [], 0
            for _ in range(calls):
                chosen = [batches[rng.randrange(len(batches))] for _ in range(k)]
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, ROLLOUT_ARROW_SCHEMA, options=options) as writer:
                    for batch in chosen:
                        writer.write_batch(batch)
                stream = sink.getvalue()
                t = time.process_time()
                table_back = pa.ipc.open_stream(stream).read_all()
                decode.append(time.process_time() - t)
                size = table_back.nbytes
            result[f"x{k}"] = {"store_ms": None, "client_ms": round(statistics.median(decode) * 1e3, 3),
                               "answer_mb": round(size / 1e6, 3)}
        return result
    reader = ShardReader(root)
    reader.read([(rel, *groups[0])])
    for path in (root / rel, lookup_path(root / rel)):  # into the page cache
        path.read_bytes()
    for k in (1, 64):
        produce, decode, sizes, wire = [], [], [], []
        for _ in range(calls):
            chosen = [(rel, *groups[rng.randrange(len(groups))]) for _ in range(k)]
            t = time.process_time()
            stream = arrow_stream(reader.messages(chosen))
            produce.append(time.process_time() - t)
            t = time.process_time()
            answer = read_stream(stream)
            decode.append(time.process_time() - t)
            sizes.append(answer.nbytes)
            wire.append(len(stream))
        result[f"x{k}"] = {"store_ms": round(statistics.median(produce) * 1e3, 3),
                           "client_ms": round(statistics.median(decode) * 1e3, 3),
                           "answer_mb": round(statistics.median(sizes) / 1e6, 3),
                           "wire_mb": round(statistics.median(wire) / 1e6, 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=["short", "reasoning"])
    parser.add_argument("--rollouts", type=int, default=8192, help="rollouts in the shard of each profile")
    parser.add_argument("--ways", nargs="+",
                        default=["copies", "ipc-lz4", "ipc-zstd", "pages-zstd", "pages-lz4_raw", "pages-none",
                                 "pages-lz4_raw-every-column"])
    parser.add_argument("--lookups", type=int, default=200, help="lookups timed per size")
    parser.add_argument("--dir", type=Path, default=Path("/work/bench-data/lookup-formats"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result: dict = {"rollouts": args.rollouts, "cpus": os.cpu_count()}
    for profile in args.profiles:
        maker = ShardMaker(args.rollouts, args.seed, profile)
        table = validate_table(maker.shard("model-a", 0, args.rollouts // GROUP, args.rollouts))
        result[profile] = {"raw_bytes_per_rollout": round(table.nbytes / table.num_rows)}
        for way in args.ways:
            root = args.dir / profile / way
            shutil.rmtree(root, ignore_errors=True)
            load = round(os.getloadavg()[0], 2)
            figures = _write(root, table, way) | _scans(root, table) | _lookups(root, table, way, args.lookups,
                                                                                  random.Random(args.seed))
            result[profile][way] = figures | {"load_avg": load}
            print(profile, way, json.dumps(figures), f"load {load}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
