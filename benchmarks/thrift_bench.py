"""The store's hand-written Thrift compact codec (services/store_api/local/thrift.py) beside maintained ones, on
what the store asks of it: reading the page headers of a shard's bulk columns (`pages.py`, every rebuild of a
lookup file and every shard a writer did not check whole) and decoding and re-encoding a shard's footer
byte for byte (`splice.py`). Prints one JSON object: microseconds per header and per footer round trip, whether
each round trip gives the same bytes, and what each costs to carry (lines of code, installed bytes).

    python -m benchmarks.thrift_bench [--profile reasoning] [--rollouts 4000] [--repeat 5]

The others, if installed (they are not the project's dependencies; `pip install thriftpy2 fastparquet cramjam`
into a scratch `--target` directory and put it on PYTHONPATH): thriftpy2 (pure-Python compact protocol, over
the parquet.thrift IDL that fastparquet ships) and fastparquet's Cython Parquet-Thrift codec
(`fastparquet.cencoding.from_buffer`). pyarrow exposes neither page headers nor a footer's bytes as structures,
so it is no candidate.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.store_data import ShardMaker
from graft.services.store_api.local import thrift
from graft.services.store_api.local.shards import encode_shard
from graft.services.store_api.tables import BULK_COLUMNS, group_runs


def shard_bytes(profile: str, rollouts: int) -> bytes:
    """A shard as the store's writer lays it out (one page or more per group of each bulk column)."""
    table = ShardMaker(rollouts, seed=0, profile=profile).shard("model-a", 0, rollouts // 8, rollouts // 16)
    sink = pa.BufferOutputStream()
    encode_shard(table, group_runs(table.column("group_id"))[1], sink)
    return sink.getvalue().to_pybytes()


def header_positions(data: bytes) -> list[int]:
    """Where each data page header of the bulk columns starts."""
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata
    names = [metadata.schema.column(j).path.split(".")[0] for j in range(metadata.num_columns)]
    positions = []
    for g in range(metadata.num_row_groups):
        for j, name in enumerate(names):
            if name not in BULK_COLUMNS:
                continue
            chunk = metadata.row_group(g).column(j)
            position, end = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size
            while position < end:
                header, length = thrift.read_struct(memoryview(data)[position:])
                positions.append(position)
                position += length + header[3]  # compressed page size
    return positions


def footer_of(data: bytes) -> bytes:
    length = int.from_bytes(data[-8:-4], "little")
    return data[-8 - length:-8]


def per_call_us(fn, calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(best / calls * 1e6, 2)


def package_bytes(module) -> int:
    root = Path(module.__file__).parent
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=("short", "reasoning"), default="reasoning")
    parser.add_argument("--rollouts", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    data = shard_bytes(args.profile, args.rollouts)
    view = memoryview(data)
    positions = header_positions(data)
    footer = footer_of(data)
    thrift_lines = len(Path(thrift.__file__).read_text().splitlines())
    result = {"profile": args.profile, "rollouts": args.rollouts, "page_headers": len(positions),
              "footer_bytes": len(footer), "codecs": {}}

    def headers(decode):
        return lambda: [decode(view[p:p + 256]) for p in positions]

    result["codecs"]["hand_written"] = {
        "header_us": per_call_us(headers(thrift.read_struct), len(positions), args.repeat),
        "footer_round_trip_us": per_call_us(
            lambda: thrift.encode_struct(bytearray(), thrift.decode_struct(footer)[0]), 1, args.repeat),
        "footer_same_bytes": bytes(thrift.encode_struct(bytearray(), thrift.decode_struct(footer)[0])) == footer,
        "lines": thrift_lines, "installed_bytes": Path(thrift.__file__).stat().st_size, "dependencies": []}

    try:
        import fastparquet
        from fastparquet import cencoding

        def fp_header(buf):
            return cencoding.from_buffer(bytes(buf), "PageHeader")

        def fp_round_trip():
            return cencoding.from_buffer(footer, "FileMetaData").to_bytes()

        result["codecs"]["fastparquet_cencoding"] = {
            "header_us": per_call_us(headers(fp_header), len(positions), args.repeat),
            "footer_round_trip_us": per_call_us(fp_round_trip, 1, args.repeat),
            "footer_same_bytes": fp_round_trip() == footer,
            "installed_bytes": package_bytes(fastparquet), "dependencies": ["pandas", "cramjam", "fsspec", "numpy"]}
        parquet_idl = Path(fastparquet.__file__).parent / "parquet.thrift"
    except ImportError as exc:
        result["codecs"]["fastparquet_cencoding"] = f"not installed: {exc}"
        parquet_idl = None

    try:
        import thriftpy2
        from thriftpy2.protocol import TCompactProtocolFactory
        from thriftpy2.transport import TMemoryBuffer

        if parquet_idl is None:
            raise ImportError("needs fastparquet's parquet.thrift")
        parquet = thriftpy2.load(str(parquet_idl), module_name="parquet_thrift")
        factory = TCompactProtocolFactory()

        def tp_decode(buf, kind):
            obj = kind()
            obj.read(factory.get_protocol(TMemoryBuffer(bytes(buf))))
            return obj

        def tp_round_trip():
            out = TMemoryBuffer()
            tp_decode(footer, parquet.FileMetaData).write(factory.get_protocol(out))
            return out.getvalue()

        result["codecs"]["thriftpy2_compact"] = {
            "header_us": per_call_us(headers(lambda b: tp_decode(b, parquet.PageHeader)), len(positions), args.repeat),
            "footer_round_trip_us": per_call_us(tp_round_trip, 1, args.repeat),
            "footer_same_bytes": tp_round_trip() == footer,
            "installed_bytes": package_bytes(thriftpy2), "dependencies": ["ply", "parquet.thrift (an IDL to ship)"]}
    except ImportError as exc:
        result["codecs"]["thriftpy2_compact"] = f"not installed: {exc}"

    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
