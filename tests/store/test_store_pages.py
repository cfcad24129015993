"""Lookups served from the shards' own pages: the page walk, the templates, and what happens when either is damaged."""

from __future__ import annotations

import ast
import inspect
import textwrap
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from store_factory import blocks_of, make_group

from graft.schemas import ROLLOUT_ARROW_SCHEMA, PeerLookupRequest, groups_to_table, table_to_groups
from graft.services.store_api.local import lookup as lookup_files
from graft.services.store_api.local import shards
from graft.services.store_api.local.index import StoreIndex
from graft.services.store_api.local.lookup import (
    BLOCK,
    BLOCK_PAGE_COUNTS,
    PageEntry,
    ShardReader,
    ShardReadError,
    lookup_path,
    rebuild_lookup_file,
)
from graft.services.store_api.local.lookup import rebuild as rebuilding
from graft.services.store_api.local.pages import BULK_BUFFERS, PageLayoutError, bulk_pages, message_buffers
from graft.services.store_api.local.splice import footer_span
from graft.services.store_api.local.thrift import decode_struct, encode_struct, read_struct
from graft.services.store_api.tables import BULK_COLUMNS, SMALL_COLUMNS_SCHEMA, group_runs


def _groups(sizes: list[int], tokens: int = 40) -> list:
    return [make_group(i, "model-a", size=size, tokens=tokens + i) for i, size in enumerate(sizes)]


def _values(page_bytes: memoryview, page) -> bytes:
    values = page_bytes[page.levels:]
    return (pa.Codec(page.codec).decompress(values, page.size).to_pybytes() if page.codec else bytes(values))


@pytest.mark.parametrize("codec", ["zstd", "lz4_raw", "none"])
@pytest.mark.parametrize("sizes", [[8] * 20, [8, 16, 8, 24, 8], [6, 4, 6, 2]], ids=["8s", "multiples-of-8", "gcd-2"])
def test_each_page_holds_whole_groups_and_decodes_to_their_values(monkeypatch, codec, sizes):
    monkeypatch.setattr(shards, "BULK_CODEC", codec)
    table = groups_to_table(_groups(sizes))
    starts, lengths = group_runs(table.column("group_id"))
    sink = pa.BufferOutputStream()
    shards.encode_shard(table, lengths, sink, row_group_rows=16)  # several row groups
    data = sink.getvalue()
    view = memoryview(data)
    pages = bulk_pages(view, pq.ParquetFile(pa.BufferReader(data)).metadata)
    for name in BULK_COLUMNS:
        assert sum(p.rows for p in pages[name]) == table.num_rows
        assert set(starts.tolist()) <= {p.first_row for p in pages[name]}  # every group starts a page
        assert {p.rows for p in pages[name]} == {np.gcd.reduce(lengths)}
        for page in pages[name]:
            body = view[page.offset:page.offset + page.length]
            assert zlib.crc32(body) == page.crc  # Parquet's page CRC, as the lookup checks it
            rows = table.slice(page.first_row, page.rows).column(name).combine_chunks()
            values = _values(body, page)
            if name == "completion_text":
                text = b"".join(s.encode() for s in rows.to_pylist())
                assert values.endswith(text)  # the lengths, then the strings' bytes
            else:
                assert values == pc.list_flatten(rows).to_numpy().tobytes()


def test_the_reader_unpacks_page_rows_in_the_page_tables_order():
    """`_splice` unpacks each page row into locals (a NamedTuple per page costs ~10% of a lookup's CPU): their names
    are PageEntry's fields, in its order, so the page table's one layout definition still governs the read."""
    source = textwrap.dedent(inspect.getsource(ShardReader._splice))
    unpacked = [tuple(e.id for e in node.target.elts) for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.For) and isinstance(node.target, ast.Tuple) and len(node.target.elts) > 2]
    assert unpacked == [PageEntry._fields]


@pytest.mark.parametrize("sizes", [[8, 16, 8, 24, 8], [6, 4, 6, 2]], ids=["multiples-of-8", "gcd-2"])
def test_groups_spanning_several_pages_are_read_whole(tmp_path, sizes):
    groups = _groups(sizes * 3)
    path = shards.write_groups(tmp_path, groups)
    blocks = blocks_of(lookup_path(path))
    # templates, some of several pages
    assert (blocks[:, BLOCK.first_page] >= 0).all() and (blocks[:, BLOCK_PAGE_COUNTS].max(0) > 1).all()
    rel = path.relative_to(tmp_path).as_posix()
    starts = np.cumsum([0] + [len(g.rollouts) for g in groups])[:-1]
    order = list(range(len(groups)))[::-1]
    got = ShardReader(tmp_path).read([(rel, int(starts[i]), len(groups[i].rollouts)) for i in order])
    got.validate(full=True)
    assert table_to_groups(got) == [groups[i] for i in order]


def test_message_buffers_finds_the_bulk_values_pyarrow_wrote():
    table = groups_to_table(_groups([4, 4]))
    template = lookup_files.template_table(table).slice(4, 4)
    real = table.slice(4, 4).combine_chunks().to_batches()[0]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ROLLOUT_ARROW_SCHEMA) as writer:
        writer.write_batch(real)
    stream = sink.getvalue().to_pybytes()
    message = stream[len(lookup_files.SCHEMA_MESSAGE):-8]
    body, buffers = message_buffers(message)
    for name, index in zip(BULK_COLUMNS, BULK_BUFFERS):
        column = real.column(name)
        if name == "completion_text":
            data = b"".join(s.encode() for s in column.to_pylist())
        else:
            data = pc.list_flatten(column).to_numpy().tobytes()
        start, length = body + int(buffers[index, 0]), int(buffers[index, 1])
        assert message[start:start + length] == data
    # a template differs from the real rows only in its bulk values, of the same sizes
    assert template.schema.equals(ROLLOUT_ARROW_SCHEMA)
    small = SMALL_COLUMNS_SCHEMA.names
    assert template.select(small).equals(pa.Table.from_batches([real]).select(small))
    length = {"completion_text": pc.binary_length}
    for name in BULK_COLUMNS:
        sizes = length.get(name, pc.list_value_length)
        assert sizes(template.column(name)).to_pylist() == sizes(real.column(name)).to_pylist()


def test_a_damaged_page_of_a_shard_fails_its_crc_and_the_store_quarantines_the_shard(settings):
    root = settings.root
    groups = [make_group(i, "peer", size=8, tokens=200) for i in range(6)]
    path = shards.write_groups(root, groups)
    index = StoreIndex(settings).open()
    try:
        page = bulk_pages(memoryview(path.read_bytes()), pq.ParquetFile(path).metadata)["token_logprobs"][2]
        damaged = bytearray(path.read_bytes())
        damaged[page.offset + page.levels + 3] ^= 0x40  # inside group 2's logprob values
        path.write_bytes(bytes(damaged))
        rel = path.relative_to(root).as_posix()
        with pytest.raises(ShardReadError, match="checksum"):
            index.catalog.reader.read([(rel, 16, 8)])
        assert table_to_groups(index.catalog.reader.read([(rel, 8, 8)])) == [groups[1]]  # its other groups read fine
        req = PeerLookupRequest(prompt_ids=[groups[2].rollouts[0].prompt_id], learner_model="learner",
                                informative_only=False, min_successes=0)
        table, _ = index.queries.read_selected(lambda: index.queries.select_peer_groups(req))
        assert table.num_rows == 0 and not path.exists()  # failed twice, from a rebuilt lookup file: quarantined
        assert index.queries.stats().quarantined_files == 1
    finally:
        index.close()


def test_a_shard_in_this_layout_without_a_lookup_file_gets_templates_from_its_small_columns(tmp_path, monkeypatch):
    groups = _groups([8] * 12, tokens=100)
    table = groups_to_table(groups)
    shard = tmp_path / "rollouts" / "model=model-a" / "part-foreign.parquet"
    shard.parent.mkdir(parents=True)
    shards.encode_shard(table, group_runs(table.column("group_id"))[1], str(shard))
    read = []
    real = rebuilding.read_whole_groups
    monkeypatch.setattr(rebuilding, "read_whole_groups", lambda *a, **k: read.append(a[2:] + tuple(k.values()))
                        or real(*a, **k))
    rebuild_lookup_file(shard)
    assert all(BULK_COLUMNS[0] not in args[0].names for args in read)  # never decoded the bulk columns
    assert (blocks_of(lookup_path(shard))[:, BLOCK.first_page] >= 0).all()
    got = ShardReader(tmp_path).read([("rollouts/model=model-a/part-foreign.parquet", 8 * g, 8) for g in (11, 0, 5)])
    assert table_to_groups(got) == [groups[11], groups[0], groups[5]]


def test_groups_with_no_tokens_and_page_headers_longer_than_a_first_read(tmp_path):
    empty = [make_group(i, "model-a", size=4, tokens=0) for i in range(3)]
    path = shards.write_groups(tmp_path, empty)
    rel = path.relative_to(tmp_path).as_posix()
    assert table_to_groups(ShardReader(tmp_path).read([(rel, 4, 4), (rel, 0, 4)])) == [empty[1], empty[0]]
    # statistics with long strings make a text page header longer than the 256 bytes first read
    long_text = [make_group(i, "model-a", size=4, tokens=20) for i in range(3)]
    table = groups_to_table(long_text)
    table = table.set_column(table.schema.get_field_index("completion_text"), "completion_text",
                             pa.array([f"{'x' * 300}{i}" for i in range(table.num_rows)]))
    table = table.set_column(table.schema.get_field_index("num_bytes"), "num_bytes",
                             pa.array([len(f"{'x' * 300}{i}") for i in range(table.num_rows)], pa.int32()))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, use_dictionary=False, compression="zstd", data_page_version="2.0",
                   max_rows_per_page=4, write_page_checksum=True,
                   column_encoding={"completion_text": "DELTA_LENGTH_BYTE_ARRAY"})
    data = sink.getvalue()
    pages = bulk_pages(memoryview(data), pq.ParquetFile(pa.BufferReader(data)).metadata)
    assert [p.rows for p in pages["completion_text"]] == [4, 4, 4]
    first = pages["completion_text"][0]
    assert _values(memoryview(data)[first.offset:first.offset + first.length], first).endswith(
        "".join(f"{'x' * 300}{i}" for i in range(4)).encode())


def test_version_1_pages_are_not_a_layout_lookups_can_read():
    table = groups_to_table(_groups([4, 4]))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, use_dictionary=False, write_page_checksum=True)
    with pytest.raises(PageLayoutError, match="version-2"):
        bulk_pages(memoryview(sink.getvalue()), pq.ParquetFile(pa.BufferReader(sink.getvalue())).metadata)


def _footer(data: bytes) -> bytes:
    start, length = footer_span(data)
    return data[start:start + length]


@pytest.mark.parametrize("options", [{}, {"compression": "zstd", "use_dictionary": False, "data_page_version": "2.0",
                                          "write_page_index": True, "max_rows_per_page": 3}], ids=["defaults", "v2"])
def test_thrift_footers_decode_and_encode_back_byte_for_byte(options):
    sink = pa.BufferOutputStream()
    pq.write_table(groups_to_table(_groups([4, 4, 4])), sink, row_group_size=5, **options)
    footer = _footer(sink.getvalue().to_pybytes())
    fields, end = decode_struct(footer)
    assert end == len(footer) and bytes(encode_struct(bytearray(), fields)) == footer


def test_a_spliced_shard_is_plain_parquet_with_small_pages_only_where_lookups_need_them(tmp_path):
    import duckdb

    groups = _groups([8] * 300, tokens=20)
    table = groups_to_table(groups)
    path = tmp_path / "spliced.parquet"
    shards.encode_shard(table, group_runs(table.column("group_id"))[1], str(path))
    assert pq.read_table(path, page_checksum_verification=True).equals(table)
    assert table_to_groups(pq.read_table(path)) == groups
    ids = ", ".join(f"'{g.rollouts[0].group_id}'" for g in groups[::37])
    counted = duckdb.sql(f"SELECT count(*), sum(num_tokens), sum(len(completion_text)), "
                         f"count(*) FILTER (WHERE group_id IN ({ids})) FROM '{path}'").fetchall()[0]
    assert counted == (2400, sum(r.num_tokens for g in groups for r in g.rollouts),
                       sum(len(r.completion_text) for g in groups for r in g.rollouts), 8 * len(groups[::37]))
    metadata = pq.ParquetFile(path).metadata
    assert metadata.num_row_groups == 3 and metadata.row_group(0).column(2).statistics.has_min_max  # prompt_id
    data = path.read_bytes()
    pages = bulk_pages(memoryview(data), metadata)
    assert all(p.rows == 8 for column in pages.values() for p in column)
    # a small column keeps pyarrow's own pages: one per row group here, not one per group
    chunk = metadata.row_group(0).column(0)
    position, seen = chunk.data_page_offset, 0
    while position < chunk.data_page_offset + chunk.total_compressed_size:
        header, start = read_struct(memoryview(data), position)
        position, seen = position + start + header[3], seen + 1
    assert seen == 1


def test_a_garbled_page_header_is_not_a_layout_and_its_shard_is_refused_whole(tmp_path):
    table = groups_to_table(_groups([8] * 4, tokens=50))
    shard = tmp_path / "rollouts" / "model=model-a" / "part-garbled.parquet"
    shard.parent.mkdir(parents=True)
    shards.encode_shard(table, group_runs(table.column("group_id"))[1], str(shard))
    data = bytearray(shard.read_bytes())
    metadata = pq.ParquetFile(shard).metadata
    text = bulk_pages(memoryview(bytes(data)), metadata)["completion_text"][1]
    header_start = text.offset - 40  # inside the second text page's header (~35 bytes)
    data[header_start:text.offset] = b"\xff" * (text.offset - header_start)
    shard.write_bytes(bytes(data))
    with pytest.raises(PageLayoutError, match="page header"):
        bulk_pages(memoryview(bytes(data)), metadata)
    with pytest.raises(ShardReadError):  # pyarrow cannot decode it either: a damaged shard, quarantined by the index
        rebuild_lookup_file(shard)
