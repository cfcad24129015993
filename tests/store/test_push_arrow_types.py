"""Arrow pushes with every column in other Arrow types and encodings (issue 23, item 6), through a real server on
loopback: a legitimate encoding is accepted and stored as the schema's type, anything else is refused with a 4xx
that names the column; never a 500."""

from __future__ import annotations

import decimal
import io

import httpx
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from store_factory import make_group

from graft.schemas import ROLLOUT_ARROW_SCHEMA, groups_to_table
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.tables import conform_table

ARROW = "application/vnd.apache.arrow.stream"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with StoreServer(tmp_path_factory.mktemp("arrow-types") / "store") as srv:
        yield srv


def arrow_body(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def push(server: StoreServer, table: pa.Table) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/groups", content=arrow_body(table), headers={"content-type": ARROW},
                      timeout=60)


def variants(column: pa.Array) -> dict[str, pa.Array]:
    """The column in other Arrow types: the encodings of the same values, nestings, and types of another kind."""
    n = len(column)
    kind = column.type
    is_list = pa.types.is_list(kind)
    text = pa.array([str(v) for v in column.to_pylist()]) if is_list else column.cast(pa.string())
    one_each = pa.array(range(n + 1), pa.int32())  # offsets of one item per row
    out = {
        "null": pa.nulls(n),
        "list": pa.ListArray.from_arrays(one_each, column),
        "struct": pa.StructArray.from_arrays([column], ["x"]),
        "string_view": text.cast(pa.string_view()),
        "large_string": text.cast(pa.large_string()),
        "binary_view": text.cast(pa.binary_view()),
        "map": pa.MapArray.from_arrays(one_each, pa.array([str(i) for i in range(n)]), pa.array([-0.5] * n, pa.float32())),
        "int64": pa.array(range(n), pa.int64()),
        "float64": pa.array([0.5] * n, pa.float64()),
        "float16": pa.array([0.5] * n, pa.float64()).cast(pa.float16()),
        "bool": pa.array([True] * n),
        "decimal": pa.array([decimal.Decimal("1.5")] * n, pa.decimal128(10, 2)),
        "date32": pa.array([1] * n, pa.int32()).cast(pa.date32()),
        "duration": pa.array([1] * n, pa.int64()).cast(pa.duration("s")),
        "fixed_size_binary": pa.array([b"ab"] * n, pa.binary(2)),
        "sparse_union": pa.UnionArray.from_sparse(pa.array([0] * n, pa.int8()), [column]),
        "dense_union": pa.UnionArray.from_dense(pa.array([0] * n, pa.int8()), pa.array(range(n), pa.int32()), [column]),
        "uuid": pa.ExtensionArray.from_storage(pa.uuid(), pa.array([b"x" * 16] * n, pa.binary(16))),
        "json": pa.ExtensionArray.from_storage(pa.json_(), text),
        "run_end_encoded": pc.run_end_encode(text if is_list else column),
    }
    if is_list:
        starts, sizes = column.offsets[:-1], pc.list_value_length(column)
        out |= {
            "large_list": column.cast(pa.large_list(kind.value_type)),
            "list_view": pa.ListViewArray.from_arrays(starts, sizes, column.values),
            "large_list_view": pa.LargeListViewArray.from_arrays(starts.cast(pa.int64()), sizes.cast(pa.int64()),
                                                                 column.values),
            "fixed_size_list": pa.FixedSizeListArray.from_arrays(column.values, len(column[0])),
            "list of dictionary": pa.ListArray.from_arrays(column.offsets, pc.dictionary_encode(column.values)),
            "list of string": pa.array([[str(x) for x in v] for v in column.to_pylist()]),
        }
    else:
        out["dictionary"] = pc.dictionary_encode(column)
    return out


@pytest.mark.parametrize("field", list(ROLLOUT_ARROW_SCHEMA), ids=lambda f: f.name)
def test_every_type_of_a_column_gets_an_answer_naming_it_never_a_500(server, field):
    table = groups_to_table([make_group(i, "types", seed=i) for i in range(2)])
    column = table.column(field.name).combine_chunks()
    answers = {}
    for name, values in variants(column).items():
        response = push(server, table.set_column(table.schema.get_field_index(field.name), field.name, values))
        answers[name] = (response.status_code, response.json().get("error", ""))
    server_errors = {name: answer for name, answer in answers.items() if answer[0] >= 500}
    assert not server_errors, server_errors
    # 409: a model_id cast from another type names another model than the one these group ids are stored for
    assert {status for status, _ in answers.values()} <= {200, 400, 409, 422}, answers
    unnamed = {name: answer for name, answer in answers.items() if answer[0] == 400 and field.name not in answer[1]}
    assert not unnamed, unnamed
    # each column has at least one type of another kind that no cast reaches: refused as the client's fault
    assert answers["struct"][0] == 400 and answers["map"][0] == 400, answers


@pytest.mark.parametrize("column", ["completion_token_ids", "token_logprobs"])
@pytest.mark.parametrize("kind", ["map", "list_view", "large_list_view"])
def test_token_columns_of_other_list_types_get_400_naming_them(server, column, kind):
    table = groups_to_table([make_group(1, "tokens", seed=1)])
    values = variants(table.column(column).combine_chunks())[kind]
    response = push(server, table.set_column(table.schema.get_field_index(column), column, values))
    assert response.status_code == 400, response.text
    assert column in response.json()["error"]


def test_a_dictionary_encoded_group_id_is_accepted_and_stored_as_strings(server):
    groups = [make_group(i, "dict-ids", seed=i) for i in range(3)]
    table = groups_to_table(groups)
    encoded = table.set_column(1, "group_id", pc.dictionary_encode(table.column("group_id")))
    assert pa.types.is_dictionary(encoded.schema.field("group_id").type)
    response = push(server, encoded)
    assert response.status_code == 200, response.text
    assert response.json()["accepted_groups"] == 3
    for group in groups:
        stored = httpx.get(f"{server.url}/v1/groups/{group.group_id}", timeout=30)
        assert stored.status_code == 200, stored.text
        assert [r["rollout_id"] for r in stored.json()["rollouts"]] == [r.rollout_id for r in group.rollouts]
        assert {r["group_id"] for r in stored.json()["rollouts"]} == {group.group_id}


@pytest.mark.parametrize("kind", ["null", "list", "struct", "string_view", "run_end_encoded", "uuid"])
def test_group_id_types_that_count_distinct_cannot_take_get_a_4xx_naming_it(server, kind):
    table = groups_to_table([make_group(1, "gid-types", seed=7)])
    response = push(server, table.set_column(1, "group_id", variants(table.column("group_id").combine_chunks())[kind]))
    assert response.status_code in (200, 400, 422), response.text
    if response.status_code != 200:
        assert "group_id" in response.json()["error"], response.text


SAME_VALUES = ("dictionary", "string_view", "large_string", "large_list", "fixed_size_list",
               "list of dictionary")


@pytest.mark.parametrize("field", list(ROLLOUT_ARROW_SCHEMA), ids=lambda f: f.name)
def test_other_encodings_of_the_same_values_conform_to_the_same_table(field):
    table = groups_to_table([make_group(i, "encodings", seed=i) for i in range(2)])
    column = table.column(field.name).combine_chunks()
    same = {name: values for name, values in variants(column).items()
            if name in SAME_VALUES and (pa.types.is_string(field.type) or not name.endswith("string_view")
                                        and name != "large_string")}
    assert same
    for name, values in same.items():
        conformed = conform_table(table.set_column(table.schema.get_field_index(field.name), field.name, values))
        assert conformed.equals(table), name
