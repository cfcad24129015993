"""Several processes against a real server: concurrent writers, a killed writer, corrupt files, restarts,
compaction under load, and the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from store_factory import make_group, wait_for
from typer.testing import CliRunner

from graft.schemas import PeerLookupRequest, table_to_groups
from graft.services.store_api.cli import app as cli_app
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer, free_port
from graft.services.store_api.local.durable import TMP_DIR
from graft.services.store_api.local.shards import write_groups

WRITER = Path(__file__).parent / "helpers" / "store_writer_proc.py"


def start_writer(root: Path, model: str, shards: int, per_shard: int, done_log: Path, offset: int = 0):
    return subprocess.Popen([sys.executable, str(WRITER), str(root), model, str(shards), str(per_shard),
                             str(done_log), str(offset)])


def closed_shards(done_log: Path) -> dict[str, list[str]]:
    if not done_log.exists():
        return {}
    return {line.split()[0]: line.split()[1:] for line in done_log.read_text().splitlines() if line.strip()}


def all_rollout_ids(client: StoreClient) -> list[str]:
    return [r for t in client.iter_rollouts(limit=1000) for r in t.column("rollout_id").to_pylist()]



def test_concurrent_writers_each_group_indexed_once(tmp_path):
    root = tmp_path / "store"
    with StoreServer(root) as server, StoreClient(server.url) as client:
        logs = [tmp_path / f"writer-{i}.log" for i in range(4)]
        writers = [start_writer(root, f"model-{i % 2}", 5, 6, log, offset=100 * i) for i, log in enumerate(logs)]
        for proc in writers:
            assert proc.wait(120) == 0
        expected = {g for log in logs for ids in closed_shards(log).values() for g in ids}
        assert len(expected) == 4 * 5 * 6
        wait_for(lambda: client.stats().total_groups == len(expected), what="every group indexed")
        stats = client.stats()
        assert stats.total_rollouts == 8 * len(expected) and stats.duplicate_groups == 0
        # the same groups pushed again through the API are recognised, not stored twice
        shard, group_ids = next(iter(closed_shards(logs[0]).items()))
        again = client.push_groups(pq.read_table(shard))
        assert again.accepted_groups == 0 and sorted(again.duplicate_groups) == sorted(group_ids)
        ids = all_rollout_ids(client)
        assert len(ids) == len(set(ids)) == 8 * len(expected)
        assert {i.rsplit("-", 1)[0] for i in ids} == expected


def test_killed_writer_leaves_no_partial_file_and_loses_nothing_closed(tmp_path):
    root = tmp_path / "store"
    done_log = tmp_path / "done.log"
    with StoreServer(root) as server, StoreClient(server.url) as client:
        writer = start_writer(root, "model-k", 1000, 40, done_log)
        model_dir = root / "rollouts" / "model=model-k"
        wait_for(lambda: len(closed_shards(done_log)) >= 3, what="three closed shards")
        wait_for(lambda: any((root / TMP_DIR).glob("model=model-k--part-*")), what="a shard being written")
        os.kill(writer.pid, signal.SIGKILL)  # mid-write
        writer.wait()
        closed = closed_shards(done_log)
        visible = sorted(model_dir.glob("part-*.parquet"))
        assert sorted(model_dir.iterdir()) == visible  # the killed writer's partial file is not in the folder
        for path in visible:
            assert pq.read_table(path).num_rows % 8 == 0  # every visible file is whole and readable
        assert set(closed) <= {str(p) for p in visible}
        assert len(visible) - len(closed) <= 1  # at most the shard renamed before its log line
        expected = {g for ids in closed.values() for g in ids}
        wait_for(lambda: client.stats().total_groups == 40 * len(visible), what="the closed shards indexed")
        for group_id in list(expected)[:: max(1, len(expected) // 20)]:
            assert client.get_group(group_id) is not None
        stats = client.stats()
        assert stats.quarantined_files == 0 and stats.total_rollouts == 8 * 40 * len(visible)


def test_corrupt_file_is_quarantined_while_serving_and_restart_rebuilds(tmp_path):
    root = tmp_path / "store"
    for model in ("model-a", "model-b"):
        write_groups(root, [make_group(i, model, step=1) for i in range(10)])
    server = StoreServer(root).start()
    client = StoreClient(server.url, retries=8, backoff_s=0.1)
    try:
        good_ids = sorted(all_rollout_ids(client))
        bad = root / "rollouts" / "model=model-a" / "part-99990101T000000Z-corrupt.parquet"
        bad.write_bytes(b"PAR1" + os.urandom(3000))
        wait_for(lambda: client.stats().quarantined_files == 1, what="quarantine")
        assert not bad.exists() and any((root / "quarantine").glob("*.reason.txt"))
        assert "quarantined" in server.log_tail(20000)
        assert client.health().status == "ok" and sorted(all_rollout_ids(client)) == good_ids
        req = PeerLookupRequest(prompt_ids=[make_group(i).prompt_id for i in range(10)], learner_model="model-a")
        before = client.lookup_peer_groups(req, validate=True)
        assert len(before.groups) == 10

        server.kill()  # crash, index as the store left it
        server.start()
        assert sorted(all_rollout_ids(client)) == good_ids
        assert client.lookup_peer_groups(req, validate=True) == before

        server.stop()
        (root / "index.duckdb").unlink()  # the index is gone: rebuilt from the Parquet files alone
        server.start()
        assert sorted(all_rollout_ids(client)) == good_ids
        assert client.lookup_peer_groups(req, validate=True) == before
        assert client.stats().quarantined_files == 1
    finally:
        client.close()
        server.stop()


def test_server_compacts_without_losing_or_doubling_groups(tmp_path):
    root = tmp_path / "store"
    expected = set()
    for shard in range(8):
        groups = [make_group(p, "peer", step=shard) for p in range(shard % 2, 16, 2)]
        write_groups(root, groups)
        expected |= {g.group_id for g in groups}
    write_groups(root, [make_group(p, "learner") for p in range(16)])
    env = {"GRAFT_STORE_COMPACT_INTERVAL_S": "0.5", "GRAFT_STORE_COMPACT_MIN_FILES": "2",
           "GRAFT_STORE_RETIRED_GRACE_S": "0.5"}
    req = PeerLookupRequest(prompt_ids=[make_group(p).prompt_id for p in range(16)], learner_model="learner",
                            groups_per_prompt=16)
    with StoreServer(root, env=env) as server, StoreClient(server.url) as client:
        problems: list[str] = []
        seen_rounds = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            table, misses = client.lookup_peer_table(req)
            ids = [g.group_id for g in table_to_groups(table, validate=False)]
            if misses or len(ids) != len(set(ids)) or set(ids) != expected:
                problems.append(f"{len(ids)} groups, {len(set(ids))} distinct, misses {misses}")
            seen_rounds += 1
            if client.stats().files == 2 and len(list((root / "rollouts" / "model=peer").glob("part-*"))) == 1:
                break
        assert not problems, problems[:3]
        assert client.stats().files == 2, "compaction did not run"
        assert seen_rounds > 1
        ids = all_rollout_ids(client)
        assert len(ids) == len(set(ids)) == 8 * 8 * 4 + 16 * 4  # every rollout once after the swap


def test_command_line_rebuild_compact_stats(tmp_path):
    root = tmp_path / "store"
    for shard in range(3):
        write_groups(root, [make_group(p, "model-a", step=shard) for p in range(5)])
    runner = CliRunner()
    result = runner.invoke(cli_app, ["rebuild", "--root", str(root)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1]) == {"groups": 15, "rollouts": 60, "files": 3}
    result = runner.invoke(cli_app, ["compact", "--root", str(root)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["files_merged"] == 3 and report["files_written"] == 1 and report["files_deleted"] == 3
    assert len(list((root / "rollouts" / "model=model-a").glob("part-*.parquet"))) == 1
    result = runner.invoke(cli_app, ["stats", "--root", str(root), "--port", "9"])  # no server there: offline
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output.strip().splitlines()[-1])
    assert stats["total_groups"] == 15 and stats["files"] == 1
    with StoreServer(root) as server:
        out = subprocess.run([sys.executable, "-m", "graft.services.store_api.cli", "stats", "--port", str(server.port)],
                             capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0 and json.loads(out.stdout)["total_rollouts"] == 60
        locked = runner.invoke(cli_app, ["rebuild", "--root", str(root)])
        assert locked.exit_code == 1 and "held by another process" in locked.output


def test_command_line_reads_create_no_store(tmp_path, monkeypatch):
    """`graft-store stats` with no server answering and no store at the root (the default stores/local, or a
    mistyped --root) says that none answers and exits 1, creating nothing; `compact` of a root that holds no
    store says so, creating nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GRAFT_STORE_ROOT", raising=False)
    port = str(free_port())  # nothing listens there
    runner = CliRunner()
    result = runner.invoke(cli_app, ["stats", "--port", port])
    assert result.exit_code == 1, result.output
    assert f"no store answers on http://127.0.0.1:{port}" in result.output
    result = runner.invoke(cli_app, ["stats", "--port", port, "--root", str(tmp_path / "typo")])
    assert result.exit_code == 1 and "holds no store" in result.output, result.output
    result = runner.invoke(cli_app, ["compact", "--root", str(tmp_path / "typo")])
    assert result.exit_code == 1 and "holds no store" in result.output, result.output
    assert list(tmp_path.iterdir()) == []
