"""The shard writer and the vectorised validator: round trips, the same rules as the pydantic models."""

from __future__ import annotations

import math
import os
from datetime import datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from store_factory import blocks_of, make_group, make_problem

from graft.schemas import (
    PROBLEM_ARROW_SCHEMA,
    ROLLOUT_ARROW_SCHEMA,
    Rollout,
    RolloutGroup,
    groups_to_table,
    table_to_groups,
)
from graft.services.store_api.local.durable import TMP_PREFIX
from graft.services.store_api.local.lookup import BLOCK, ShardReader, ShardReadError, lookup_path
from graft.services.store_api.local.lookup import writer as lookup_writer
from graft.services.store_api.local.pages import bulk_pages
from graft.services.store_api.local.shards import BULK_COLUMNS, ROW_GROUP_ROWS, write_groups
from graft.services.store_api.tables import ShardValidationError, groups_table, validate_table


def test_round_trip_through_a_shard(tmp_path):
    groups = [make_group(i, "model-a", step=3, size=8, tokens=20) for i in range(30)]
    path = write_groups(tmp_path, groups, problems=[make_problem(i) for i in range(30)])

    assert path.parent == tmp_path / "rollouts" / "model=model-a"
    assert path.name.startswith("part-") and path.suffix == ".parquet"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(TMP_PREFIX)]
    back = table_to_groups(pq.read_table(path))
    assert back == groups  # every field, every rollout, same order

    reader = ShardReader(tmp_path)
    rel = path.relative_to(tmp_path).as_posix()
    middle = reader.read([(rel, 8 * 17, 8), (rel, 0, 8)])
    assert table_to_groups(middle) == [groups[17], groups[0]]

    problems = pq.read_table(next((tmp_path / "prompts" / "dataset=toy-math").glob("part-*.parquet")))
    assert problems.schema.equals(PROBLEM_ARROW_SCHEMA, check_metadata=False)
    assert sorted(problems.column("prompt_id").to_pylist()) == sorted(make_problem(i).prompt_id for i in range(30))


def test_row_groups_and_pages_hold_whole_groups_and_only_bulk_columns_are_compressed(tmp_path):
    # 6 does not divide the row group target
    groups = [make_group(i, "model-a", size=6, tokens=2) for i in range(ROW_GROUP_ROWS // 6 + 20)]
    path = write_groups(tmp_path, groups)
    metadata = pq.ParquetFile(path).metadata
    assert metadata.num_row_groups > 1
    for i in range(metadata.num_row_groups):
        row_group = metadata.row_group(i)
        assert row_group.num_rows % 6 == 0 and row_group.num_rows <= ROW_GROUP_ROWS
        for j in range(row_group.num_columns):
            column = row_group.column(j)
            expected = "LZ4" if column.path_in_schema.split(".")[0] in BULK_COLUMNS else "UNCOMPRESSED"  # LZ4_RAW
            assert column.compression == expected, column.path_in_schema
    pages = bulk_pages(memoryview(path.read_bytes()), metadata)
    assert all(page.rows == 6 for column in pages.values() for page in column)  # a page per group


def test_lookup_file_holds_each_group_and_is_rebuilt_when_missing_or_damaged(tmp_path):
    groups = [make_group(i, "model-a", size=8, tokens=30) for i in range(12)]
    path = write_groups(tmp_path, groups)
    lookup = lookup_path(path)
    assert lookup == tmp_path / "lookup" / "model=model-a" / (path.stem + ".lookup")
    written = lookup.read_bytes()
    # templates only: the bulk values stay in the shard's pages (no token id list of a group is in the file)
    assert all(blocks_of(lookup)[:, BLOCK.first_page] >= 0)
    ids = pa.array(groups[3].rollouts[0].completion_token_ids, pa.int32()).buffers()[1].to_pybytes()
    assert ids in pq.read_table(path).column("completion_token_ids").combine_chunks().values.buffers()[1].to_pybytes()
    assert ids not in written
    rel = path.relative_to(tmp_path).as_posix()
    wanted = [(rel, 8 * 5, 8), (rel, 8 * 11, 8), (rel, 0, 8)]

    lookup.unlink()
    reader = ShardReader(tmp_path)
    assert table_to_groups(reader.read(wanted)) == [groups[5], groups[11], groups[0]]  # rebuilt from the shard
    assert lookup.read_bytes() == written

    damaged = bytearray(written)
    damaged[len(written) // 2] ^= 0xFF  # inside some group's message
    lookup.write_bytes(bytes(damaged))
    reader = ShardReader(tmp_path)
    with pytest.raises(ShardReadError, match="checksum"):
        reader.read([(rel, 8 * g, 8) for g in range(12)])
    assert table_to_groups(reader.read(wanted)) == [groups[5], groups[11], groups[0]]
    assert lookup.read_bytes() == written

    lookup.write_bytes(written[:-10])  # torn: the trailer is gone
    assert table_to_groups(ShardReader(tmp_path).read(wanted[:1])) == [groups[5]]
    with pytest.raises(ShardReadError, match="no group"):
        ShardReader(tmp_path).read([(rel, 3, 8)])  # not where a group starts


@pytest.mark.parametrize("loss", ["empty", "page_of_zeros", "tail_of_zeros", "cut_at_a_page"])
def test_lookup_file_lost_in_a_crash_is_rebuilt_from_the_shard(tmp_path, loss):
    # lookup files are renamed without an fsync of the file or its directory: after a power loss the file may
    # be empty, cut at a page, or have pages that never reached the disk (zeros) under a valid-looking size
    groups = [make_group(i, "model-a", size=8, tokens=300) for i in range(12)]
    path = write_groups(tmp_path, groups)
    lookup = lookup_path(path)
    written = lookup.read_bytes()
    assert len(written) > 3 * 4096
    damaged = bytearray(written)
    if loss == "empty":
        damaged = bytearray()
    elif loss == "page_of_zeros":
        damaged[4096:8192] = bytes(4096)
    elif loss == "tail_of_zeros":  # the block table and trailer pages lost
        start = (len(written) - 100) // 4096 * 4096
        damaged[start:] = bytes(len(written) - start)
    else:
        damaged = damaged[:len(written) // 4096 * 4096]
    lookup.write_bytes(bytes(damaged))
    rel = path.relative_to(tmp_path).as_posix()
    everything = [(rel, 8 * g, 8) for g in range(12)]

    reader = ShardReader(tmp_path)
    try:
        got = reader.read(everything)
    except ShardReadError as exc:  # zeros inside a group's message: its CRC catches them, the file is deleted
        assert loss == "page_of_zeros" and "checksum" in str(exc)
        got = reader.read(everything)
    assert table_to_groups(got) == groups
    assert lookup.read_bytes() == written


def _resident_pages(path) -> int:
    """Pages of the file in the page cache (mincore on a read-only mapping; mapping reads nothing)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vector)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="page cache advice is Linux-only")
def test_written_files_leave_the_page_cache(tmp_path):
    # a writer never reads back what it wrote: keeping it cached cost 14-18 us of kernel time per 4 KB page on
    # the benchmark VM once the cache outgrew recently used memory (benchmarks/RESULTS.md, Store)
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * (1 << 20))
    fd = os.open(probe, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident_pages(probe) > 16:
        pytest.skip("this file system keeps dropped pages (tmpfs?)")
    groups = [make_group(i, "model-a", size=8, tokens=2000) for i in range(40)]
    path = write_groups(tmp_path, groups)
    lookup = lookup_path(path)
    assert path.stat().st_size > 1 << 20 and lookup.stat().st_size > 32 * 4096
    assert _resident_pages(path) <= 4 and _resident_pages(lookup) <= 4
    rel = path.relative_to(tmp_path).as_posix()
    assert table_to_groups(ShardReader(tmp_path).read([(rel, 8 * 39, 8), (rel, 0, 8)])) == [groups[39], groups[0]]
    assert table_to_groups(pq.read_table(path)) == groups  # and both read back whole from disk


def test_lookup_file_of_a_foreign_shard_whose_groups_span_row_groups(tmp_path):
    groups = [make_group(i, "model-f", size=4) for i in range(9)]
    shard = tmp_path / "rollouts" / "model=model-f" / "part-foreign.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(groups_to_table(groups), shard, row_group_size=5)  # no lookup file, groups cut across row groups
    reader = ShardReader(tmp_path)
    rel = shard.relative_to(tmp_path).as_posix()
    assert table_to_groups(reader.read([(rel, 4 * g, 4) for g in (8, 0, 3)])) == [groups[8], groups[0], groups[3]]
    assert all(blocks_of(lookup_path(shard))[:, BLOCK.first_page] == -1)  # version-1 pages: every group copied whole
    everything = reader.read([(rel, 4 * g, 4) for g in range(9)])
    assert everything.equals(pq.read_table(shard).cast(ROLLOUT_ARROW_SCHEMA))


def test_arrow_path_writes_the_same_rows_as_the_model_path(tmp_path):
    groups = [make_group(i, "model-b", size=4) for i in range(10)]
    from_models = pq.read_table(write_groups(tmp_path / "a", groups))
    from_arrow = pq.read_table(write_groups(tmp_path / "b", groups_to_table(groups)))
    assert from_models.equals(from_arrow)
    assert from_arrow.schema.equals(ROLLOUT_ARROW_SCHEMA, check_metadata=False)


def test_groups_table_builds_what_the_schemas_builder_builds(tmp_path):
    plain = make_group(1, "model-a", size=8, tokens=40)
    odd = [Rollout(**{**r.model_dump(), "top_k": 40, "extracted_answer": None})
           for r in make_group(2, "model-a", rewards=[1.0, None, 0.0], tokens=0).rollouts]
    naive_time = make_group(3, "model-a", created_at=datetime(2024, 5, 1, 12, 0, 0))  # pydantic makes it UTC
    groups = [plain, RolloutGroup(rollouts=odd), naive_time]
    assert groups_table(groups).equals(groups_to_table(groups), check_metadata=True)
    assert groups_table([]).num_rows == 0

    # the models refuse such ids (le=2**31 - 1); groups built without validation meet the table builder's check
    too_big = [r.model_copy(update={"completion_token_ids": [2**40] * r.num_tokens}) for r in plain.rollouts]
    with pytest.raises(ShardValidationError,
                       match=r"completion_token_ids does not fit list<item: int32>.*out of bounds"):
        write_groups(tmp_path, [RolloutGroup.model_construct(rollouts=too_big)])
    assert not list(tmp_path.rglob("*.parquet"))


def test_lookup_file_is_the_same_however_it_is_chunked(tmp_path, monkeypatch):
    groups = [make_group(i, "model-a", size=8, tokens=30) for i in range(7)]
    path = write_groups(tmp_path, groups)
    written = lookup_path(path).read_bytes()
    rel = path.relative_to(tmp_path).as_posix()
    for chunk_bytes in (1, 20_000):  # every group its own chunk; a few groups per chunk
        monkeypatch.setattr(lookup_writer, "LOOKUP_CHUNK_BYTES", chunk_bytes)
        lookup_path(path).unlink()
        reader = ShardReader(tmp_path)
        assert table_to_groups(reader.read([(rel, 8 * g, 8) for g in (6, 0, 3)])) == [groups[6], groups[0], groups[3]]
        assert lookup_path(path).read_bytes() == written


def test_validator_names_the_row_where_a_shared_field_changes_or_a_group_field_is_bad():
    rows = _rows(make_group(6)) + _rows(make_group(7))
    rows[6]["dataset"] = "other"
    with pytest.raises(ShardValidationError,
                       match=rf"row 6 \(group {rows[6]['group_id']}\): dataset = 'other' but the group's first rollout "
                             "has 'toy-math'"):
        validate_table(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA))
    rows = _rows(make_group(6)) + [{**r, "prompt_id": "0123456789ABCDEF"} for r in _rows(make_group(7))]
    with pytest.raises(ShardValidationError,
                       match=rf"row 4 \(group {rows[4]['group_id']}.*prompt_id must be 16 lowercase"):
        validate_table(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA))


def test_one_model_per_shard_and_no_empty_writes(tmp_path):
    with pytest.raises(ShardValidationError, match="one model's groups"):
        write_groups(tmp_path, [make_group(1, "model-a"), make_group(1, "model-b")])
    with pytest.raises(ShardValidationError, match="no groups"):
        write_groups(tmp_path, [])
    assert not list(tmp_path.rglob("*.parquet"))


def _rows(group: RolloutGroup) -> list[dict]:
    return [r.model_dump() for r in group.rollouts]


def _set(index: int, **changes):
    def mutate(rows):
        rows[index].update(changes)
        return rows
    return mutate


def _bad_logprob(value):
    def mutate(rows):
        rows[1]["token_logprobs"] = [value] + rows[1]["token_logprobs"][1:]
        return rows
    return mutate


MUTATIONS = {
    "top_p above 1": _set(0, top_p=1.5),
    "negative temperature": _set(0, temperature=-0.1),
    "num_tokens mismatch": _set(1, num_tokens=3),
    "num_bytes mismatch": _set(2, num_bytes=1),
    "correct disagrees with reward": _set(0, correct=False),
    "reward above 1": _set(0, reward=2.0, correct=True),
    "positive logprob": _bad_logprob(0.5),
    "nan logprob": _bad_logprob(math.nan),
    "positive logprob_sum": _set(0, logprob_sum=1.0),
    "wrong advantage": _set(0, advantage=5.0),
    "bad prompt id": lambda rows: [{**r, "prompt_id": "XYZ"} for r in rows],
    "unsafe model id": lambda rows: [{**r, "model_id": "../evil"} for r in rows],
    "unknown finish reason": _set(3, finish_reason="eos"),
    "group size mismatch": lambda rows: [{**r, "group_size": 5} for r in rows],
    "repeated rollout id": lambda rows: [rows[0], {**rows[1], "rollout_id": rows[0]["rollout_id"]}, *rows[2:]],
    "mixed policy steps": _set(2, policy_step=9),
    "empty dataset": lambda rows: [{**r, "dataset": ""} for r in rows],
    "token ids and logprobs differ": lambda rows: [{**rows[0], "token_logprobs": rows[0]["token_logprobs"][:-1]}, *rows[1:]],
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_validator_rejects_what_the_models_reject(name):
    rows = MUTATIONS[name](_rows(make_group(5, "model-a", size=4)))
    with pytest.raises(ValidationError):
        RolloutGroup(rollouts=[Rollout(**r) for r in rows])
    with pytest.raises(ShardValidationError) as info:
        validate_table(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA))
    assert str(info.value)  # says which row and which rule


def test_validator_accepts_null_rewards_dr_grpo_and_names_the_bad_row():
    from graft.schemas import group_advantages

    group = make_group(3, rewards=[1.0, None, 0.0, 0.0])
    validate_table(groups_to_table([group]))
    rows = _rows(make_group(4, rewards=[1.0, 0.0, 0.0, 1.0]))
    for r, a in zip(rows, group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=False)):
        r["advantage"] = a
    validate_table(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA))

    rows = _rows(make_group(6)) + _rows(make_group(7))
    rows[6]["top_p"] = 0.0
    with pytest.raises(ShardValidationError, match=rf"row 6 \(group {rows[6]['group_id']}.*top_p"):
        validate_table(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA))


def test_split_groups_and_missing_columns_are_refused():
    a, b = _rows(make_group(1)), _rows(make_group(2))
    with pytest.raises(ShardValidationError, match="separate runs"):
        validate_table(pa.Table.from_pylist(a[:2] + b + a[2:], schema=ROLLOUT_ARROW_SCHEMA))
    table = groups_to_table([make_group(1)]).drop_columns(["advantage"])
    with pytest.raises(ShardValidationError, match="missing \\['advantage'\\]"):
        validate_table(table)
