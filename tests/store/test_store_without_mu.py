"""Rows without behaviour logprobs (logprobs_mode 'none', docs/algorithm.md section 11) through the real store: refused when
malformed, stored, served whole, filtered out by require_behaviour_logprobs with a reason, shown by the browser API;
a shard written by schema version 1 read, validated and served unchanged; and the lookup's "has mu" is the trainers'
rule (schemas.mu_is_behaviour), in a fresh index and in one written under the old meaning."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from store_factory import blocks_of, make_group, problem_text

from graft.schemas import (
    ARROW_MEDIA_TYPE,
    PeerLookupRequest,
    Rollout,
    RolloutGroup,
    groups_to_table,
    prompt_id,
    table_to_groups,
)
from graft.schemas.rollout import ADDED_COLUMNS
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local.lookup import BLOCK, lookup_path
from graft.services.store_api.local.shards import write_groups
from graft.services.store_api.tables import ShardValidationError, validate_table

V1_STORE = Path(__file__).parent / "data" / "v1_store"  # written by the store of e5bf61a (schema version 1)
# written by the store of d13b8d8 (schema version 2): a group without mu (logprob_sum 0.0) and one with, a shard each
V2_STORE = Path(__file__).parent / "data" / "v2_store"


def test_a_row_without_mu_that_holds_logprobs_or_a_group_mixing_modes_is_refused():
    good = make_group(1, "text-peer", without_mu=True)
    row = good.rollouts[0].model_dump()
    with pytest.raises(ValidationError, match="logprobs_mode = 'none'.*token_logprobs has 12 entries"):
        Rollout(**{**row, "token_logprobs": [-0.5] * 12})
    with pytest.raises(ValidationError, match="logprob_sum = -1.0"):
        Rollout(**{**row, "logprob_sum": -1.0})
    with_mu = make_group(1, "text-peer")
    mixed = [with_mu.rollouts[0], *(r.model_copy(update={"group_id": with_mu.group_id,
                                                        "rollout_id": f"{with_mu.group_id}-{i}"})
                                     for i, r in enumerate(good.rollouts[1:], start=1))]
    with pytest.raises(ValidationError, match="mixes rows with logprobs_mode 'none'"):
        RolloutGroup(rollouts=mixed)

    # the store's vectorised check (every push, shard and lake commit) says the same, naming the row
    table = groups_to_table([good])
    assert validate_table(table).num_rows == 4
    lists = table.column("token_logprobs").to_pylist()
    lists[2] = [-0.5] * 12
    bad = table.set_column(table.schema.get_field_index("token_logprobs"), "token_logprobs",
                           pa.array(lists, pa.list_(pa.float32())))
    with pytest.raises(ShardValidationError, match=r"row 2 .*logprobs_mode is 'none' .*token_logprobs is not empty"):
        validate_table(bad)
    sums = table.column("logprob_sum").to_pylist()
    sums[1] = -3.0
    bad = table.set_column(table.schema.get_field_index("logprob_sum"), "logprob_sum", pa.array(sums, pa.float64()))
    with pytest.raises(ShardValidationError, match=r"row 1 .*logprobs_mode is 'none' .*logprob_sum is not null"):
        validate_table(bad)
    table = groups_to_table([with_mu])
    changes = {"logprobs_mode": ["processed", "processed", "none", "processed"],
               "token_logprobs": [r.token_logprobs if i != 2 else [] for i, r in enumerate(with_mu.rollouts)],
               "logprob_sum": [r.logprob_sum if i != 2 else None for i, r in enumerate(with_mu.rollouts)]}
    for name, values in changes.items():
        index = table.schema.get_field_index(name)
        table = table.set_column(index, name, pa.array(values, table.schema.field(name).type))
    with pytest.raises(ShardValidationError, match="mixes rows with logprobs_mode 'none' and rows with behaviour"):
        validate_table(table)


def test_groups_without_mu_are_stored_served_and_left_out_when_the_learner_asks_for_mu(tmp_path):
    root = tmp_path / "store"
    only_text = make_group(500, "text-peer", step=5, size=8, without_mu=True)
    newer_text = make_group(502, "text-peer", step=5, without_mu=True)
    older_mu = make_group(502, "peer", step=3)
    write_groups(root, [only_text, newer_text])
    second = write_groups(root, [older_mu])
    lookup_path(second).unlink()  # this shard's groups are decoded whole at ingest and its lookup file rebuilt
    ids = [prompt_id(problem_text(i)) for i in (500, 502)]
    with StoreServer(root) as srv, StoreClient(srv.url) as client:
        found = client.lookup_peer_groups(PeerLookupRequest(prompt_ids=ids, learner_model="learner"), validate=True)
        assert found.groups == [only_text, newer_text] and found.misses == []  # every stored field, empty logprobs too
        assert all(r.token_logprobs == [] and r.logprob_sum is None for g in found.groups for r in g.rollouts)
        assert client.get_group(only_text.group_id) == only_text

        body = {"prompt_ids": ids, "learner_model": "learner", "require_behaviour_logprobs": True}
        mu_only = client.lookup_peer_groups(PeerLookupRequest(**body), validate=True)
        as_json = httpx.post(f"{srv.url}/v1/peer-groups/lookup", json=body).json()
        as_arrow = pa.ipc.open_stream(httpx.post(f"{srv.url}/v1/peer-groups/lookup", json=body,
                                                 headers={"accept": ARROW_MEDIA_TYPE}).content).read_all()
        tokens = httpx.get(f"{srv.url}/v1/groups/{only_text.group_id}/tokens").json()
        with_mu_tokens = httpx.get(f"{srv.url}/v1/groups/{older_mu.group_id}/tokens").json()
    assert mu_only.groups == [older_mu] and mu_only.misses == [ids[0]]
    assert mu_only.miss_reasons == {ids[0]: "only_without_mu"} == as_json["miss_reasons"]
    assert orjson.loads(as_arrow.schema.metadata[b"miss_reasons"]) == {ids[0]: "only_without_mu"}
    assert [RolloutGroup.model_validate(g) for g in as_json["groups"]] == [older_mu]
    # the browser's token view says there is nothing to colour instead of showing a probability
    assert tokens["behaviour_logprobs"] is False and "no behaviour logprobs" in tokens["note"]
    assert with_mu_tokens["behaviour_logprobs"] is True and "no behaviour logprobs" not in with_mu_tokens["note"]
    # both shards' lookup files hold templates (the bulk values read from the shard's pages), the rebuilt one too
    for shard in (root / "rollouts").rglob("*.parquet"):
        assert (blocks_of(lookup_path(shard))[:, BLOCK.first_page] >= 0).all(), shard


def test_a_shard_of_schema_version_1_reads_validates_and_is_served_unchanged(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(V1_STORE, root)
    shard = next((root / "rollouts").rglob("*.parquet"))
    table = pq.read_table(shard)
    assert table.schema.metadata[b"graft_schema_version"] == b"1"
    assert set(table.column("schema_version").to_pylist()) == {1}
    assert validate_table(table).num_rows == 12
    stored = set(table.column("group_id").to_pylist())
    ids = [prompt_id(problem_text(900 + i)) for i in range(3)]
    with StoreServer(root) as srv, StoreClient(srv.url) as client:
        found = client.lookup_peer_groups(PeerLookupRequest(prompt_ids=ids, learner_model="learner",
                                                            require_behaviour_logprobs=True), validate=True)
    assert {g.group_id for g in found.groups} == stored and found.misses == []
    assert all(r.schema_version == 1 and r.logprobs_mode == "processed" and len(r.token_logprobs) == r.num_tokens
               for g in found.groups for r in g.rollouts)
    served = groups_to_table(found.groups)
    # every value as the version-1 writer stored it; the columns of version 3 (the prompt followed) read as null
    assert served.drop_columns(list(ADDED_COLUMNS)).to_pylist() == table.to_pylist()
    assert all(served.column(name).null_count == served.num_rows for name in ADDED_COLUMNS)


def test_shards_of_schema_version_2_read_validate_and_are_served_unchanged(tmp_path):
    """A version-2 row without mu keeps its logprob_sum 0.0 (version 3 writes null); both shards' lookup files, of
    the previous lookup version, are rebuilt; every value is served as the version-2 writer stored it."""
    root = tmp_path / "store"
    shutil.copytree(V2_STORE, root)
    tables = {shard.name: pq.read_table(shard) for shard in sorted((root / "rollouts").rglob("*.parquet"))}
    assert all(t.schema.metadata[b"graft_schema_version"] == b"2" and ADDED_COLUMNS[0] not in t.column_names
               for t in tables.values())
    without_mu = tables["part-v2a.parquet"]
    assert set(without_mu.column("logprobs_mode").to_pylist()) == {"none"}
    assert set(without_mu.column("logprob_sum").to_pylist()) == {0.0}
    assert all(validate_table(t).num_rows == 4 for t in tables.values())
    with pytest.raises(ShardValidationError, match="logprob_sum is not null"):  # the same row written as version 3
        validate_table(without_mu.set_column(without_mu.schema.get_field_index("schema_version"), "schema_version",
                                             pa.array([3] * 4, pa.int32())))
    ids = [prompt_id(problem_text(910 + i)) for i in range(2)]
    with StoreServer(root) as srv, StoreClient(srv.url) as client:
        found = client.lookup_peer_groups(PeerLookupRequest(prompt_ids=ids, learner_model="learner"), validate=True)
    served = groups_to_table(found.groups)
    assert served.drop_columns(list(ADDED_COLUMNS)).to_pylist() == pa.concat_tables(tables.values()).to_pylist()
    assert [g.has_behaviour_logprobs for g in found.groups] == [False, True]


def test_compaction_and_a_rebuild_keep_groups_without_mu_whole_and_known(settings):
    """Shards of groups with and without mu merged into one (compaction), then the index rebuilt from the files: every
    group served as written, and the lookup still tells the two kinds apart."""
    from graft.services.store_api.local.index import StoreIndex

    groups = [make_group(600 + i, "mixed-peer", step=i, without_mu=i % 2 == 1) for i in range(6)]
    for start in range(0, 6, 2):
        write_groups(settings.root, groups[start:start + 2])
    ids = [g.prompt_id for g in groups]
    index = StoreIndex(settings).open()
    try:
        report = index.compaction.compact(model_id="mixed-peer", min_files=2)
        index.compaction.delete_retired(grace_s=0)
        assert report["files_merged"] == 3 and report["groups_moved"] == 6
        for _ in range(2):  # after the compaction, and after a rebuild of the index from the files
            every, _ = index.queries.read_selected(lambda: index.queries.select_peer_groups(
                PeerLookupRequest(prompt_ids=ids, learner_model="learner")))
            with_mu, misses = index.queries.read_selected(lambda: index.queries.select_peer_groups(
                PeerLookupRequest(prompt_ids=ids, learner_model="learner", require_behaviour_logprobs=True)))
            assert sorted(g.group_id for g in table_to_groups(every)) == sorted(g.group_id for g in groups)
            assert {g.group_id: g for g in table_to_groups(every)} == {g.group_id: g for g in groups}
            assert {g.group_id for g in table_to_groups(with_mu)} == {g.group_id for g in groups[0::2]}
            assert set(misses) == {g.prompt_id for g in groups[1::2]}
            assert index.rebuild() == 6
    finally:
        index.close()


def test_an_index_of_version_2_gains_has_mu_in_place_instead_of_a_rebuild(tmp_path):
    """An index written before groups.has_mu (version 2: it indexed only rows with mu) is kept, the column added as
    true for every group; nothing is set aside and rebuilt from the files."""
    import duckdb

    from graft.services.store_api.local.index import StoreIndex
    from graft.services.store_api.settings import StoreSettings

    root = tmp_path / "store"
    shutil.copytree(V1_STORE, root)
    settings = StoreSettings(root=root, compact_interval_s=0)
    StoreIndex(settings).open().close()
    with duckdb.connect(str(root / "index.duckdb")) as con:  # the index as version 2 had it
        con.execute("ALTER TABLE groups DROP COLUMN has_mu")
        con.execute("UPDATE meta SET value = '2' WHERE key = 'index_version'")
    index = StoreIndex(settings).open()
    try:
        ids = [prompt_id(problem_text(900 + i)) for i in range(3)]
        refs, misses = index.queries.select_peer_groups(PeerLookupRequest(prompt_ids=ids, learner_model="learner",
                                                                  require_behaviour_logprobs=True))
        assert len(refs) == 3 and misses == {} and all(ref.has_mu for ref in refs)
        version = index.catalog.cursor().execute("SELECT value FROM meta WHERE key = 'index_version'").fetchone()
        assert version == ("4",)
        write_groups(root, [make_group(910, "text-peer", without_mu=True)])  # new groups index with their own value
        assert index.ingest.ingest_new() == 1
        refs, misses = index.queries.select_peer_groups(PeerLookupRequest(prompt_ids=[prompt_id(problem_text(910))],
                                                                  learner_model="learner"))
        assert [ref.has_mu for ref in refs] == [False]
    finally:
        index.close()
    assert not list(root.glob("index.duckdb.broken-*"))


def _sampled_as(group: RolloutGroup, mode: str, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int | None = None) -> RolloutGroup:
    """`group` (with logprobs) relabelled: its rows' logprobs_mode and sampling settings."""
    update = {"logprobs_mode": mode, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    return RolloutGroup(rollouts=[r.model_copy(update=update) for r in group.rollouts])


def _kinds_of_mu() -> dict[str, tuple[RolloutGroup, bool]]:
    """One group per kind of stored logprobs, and whether they are the rows' behaviour mu."""
    def group(prompt: int) -> RolloutGroup:
        return make_group(prompt, "kinds-peer")

    return {
        "processed at T 0.7, top-k 20": (_sampled_as(group(700), "processed", 0.7, top_k=20), True),
        "rescored": (_sampled_as(group(701), "rescored", 0.7), True),
        "raw at T 1": (_sampled_as(group(702), "raw"), True),
        "raw at T 0.7": (_sampled_as(group(703), "raw", 0.7), False),
        "raw at T 1, top-p 0.9": (_sampled_as(group(704), "raw", top_p=0.9), False),
        "raw at T 1, top-k 20": (_sampled_as(group(705), "raw", top_k=20), False),
        "greedy (raw at T 0)": (_sampled_as(group(706), "raw", 0.0), False),
        "rescored_unverified": (_sampled_as(group(707), "rescored_unverified"), False),
        "none": (make_group(708, "kinds-peer", without_mu=True), False),
    }


def test_require_behaviour_logprobs_serves_the_groups_whose_logprobs_are_mu_by_the_trainers_rule(settings):
    """A store holding every kind of stored logprobs: under require_behaviour_logprobs the lookup serves exactly the
    groups the trainers use as mu (schemas.mu_is_behaviour without trust in rescored_unverified), and says why for the
    rest; without it, every group. The Python rule (PeerLookupRequest.accepts_group) agrees with the index."""
    from graft.services.store_api.local.index import StoreIndex

    kinds = _kinds_of_mu()
    write_groups(settings.root, [g for g, _ in kinds.values()])
    ids = [g.prompt_id for g, _ in kinds.values()]
    index = StoreIndex(settings).open()
    try:
        def served(require: bool) -> tuple[set[str], dict[str, str]]:
            request = PeerLookupRequest(prompt_ids=ids, learner_model="learner", require_behaviour_logprobs=require)
            table, misses = index.queries.read_selected(lambda: index.queries.select_peer_groups(request))
            return {g.group_id for g in table_to_groups(table)}, misses

        with_mu, misses = served(True)
        expected = {name for name, (g, mu) in kinds.items() if mu}
        assert {name for name, (g, _) in kinds.items() if g.group_id in with_mu} == expected
        assert misses == {g.prompt_id: "only_without_mu" for g, mu in kinds.values() if not mu}
        assert served(False)[0] == {g.group_id for g, _ in kinds.values()}
        rule = PeerLookupRequest(prompt_ids=ids, learner_model="learner", require_behaviour_logprobs=True)
        assert {name for name, (g, _) in kinds.items() if rule.accepts_group(g, now_us=2**62)} == expected
    finally:
        index.close()


def test_an_index_of_version_3_has_has_mu_recomputed_in_place(settings):
    """An index of version 3 said has_mu for every group with logprobs ('raw' ones at any temperature too): opened by
    this store, has_mu is recomputed from the shards' columns (mu_is_behaviour), and nothing is rebuilt."""
    import duckdb

    from graft.services.store_api.local.index import StoreIndex

    kinds = _kinds_of_mu()
    write_groups(settings.root, [g for g, _ in kinds.values()])
    StoreIndex(settings).open().close()
    with duckdb.connect(str(settings.root / "index.duckdb")) as con:  # the index as version 3 had it
        con.execute("UPDATE groups SET has_mu = (group_id != ?)", [kinds["none"][0].group_id])
        con.execute("UPDATE meta SET value = '3' WHERE key = 'index_version'")
    index = StoreIndex(settings).open()
    try:
        has_mu = dict(index.catalog.cursor().execute("SELECT group_id, has_mu FROM groups").fetchall())
        assert {name: has_mu[g.group_id] for name, (g, _) in kinds.items()} == {n: mu for n, (_, mu) in kinds.items()}
        assert index.catalog.cursor().execute("SELECT value FROM meta WHERE key = 'index_version'").fetchone() == ("4",)
    finally:
        index.close()
    assert not list(settings.root.glob("index.duckdb.broken-*"))
