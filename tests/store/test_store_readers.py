"""docs/stored-row.md's outside-reader queries (DuckDB from Python and its SQL, pyarrow), run as written against a store
SIGKILLed while pushing and while a writer wrote, and against one that just compacted: they count exactly what
the API counts, and no glob of the folder meets a partial file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
from store_factory import make_group

from graft.schemas import ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.http.client import StoreClient, StoreError
from graft.services.store_api.http.testing import StoreServer
from graft.services.store_api.local.shards import write_groups

REPOSITORY = Path(__file__).resolve().parents[2]
README = REPOSITORY / "README.md"
STORED_ROW = REPOSITORY / "docs" / "stored-row.md"
WRITER = Path(__file__).parent / "helpers" / "store_writer_proc.py"


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", STORED_ROW.read_text(), flags=re.S)


def readme_counts(root: Path) -> dict[str, dict[str, int]]:
    """Rollouts per model by each of docs/stored-row.md's outside readers, run as written on `root`."""
    python, sql = [b for b in readme_blocks("python") if "manifest.json" in b]
    namespace: dict = {}
    exec(python.replace("stores/local", str(root)), namespace)
    counts = {"duckdb": {m: n for m, n, _ in namespace["per_model"]},
              "pyarrow": {row["model_id"]: row["model_id_count"]
                          for row in namespace["table"].group_by("model_id").aggregate([("model_id", "count")]).to_pylist()}}
    # no column from the folders' names (model=<id>): the rows' own fields only, whichever reader
    assert namespace["table"].column_names == ROLLOUT_ARROW_SCHEMA.names
    sql_namespace: dict = {}
    exec(sql.replace("stores/local", str(root)), sql_namespace)
    connection = sql_namespace["con"]
    counts["duckdb sql"] = {m: n for m, n, _ in connection.execute(sql_namespace["PER_MODEL"]).fetchall()}
    star = sql_namespace["PER_MODEL"].replace("model_id, count(*) AS rollouts, avg(reward) AS success_rate", "*", 1)
    assert [column[0] for column in connection.execute(star.split(" GROUP BY")[0]).description] == ROLLOUT_ARROW_SCHEMA.names
    return counts


def api_counts(client: StoreClient) -> dict[str, int]:
    return {m.model_id: m.rollouts for m in client.stats().models}


def glob_rows(root: Path) -> int:
    """What a plain glob of the folder counts (the README's old way); raises on a partial file."""
    return duckdb.sql(f"SELECT count(*) FROM '{root}/rollouts/*/*.parquet'").fetchall()[0][0]


def writing(root: Path, model: str) -> bool:
    """Whether a temporary file of a `model` shard exists anywhere under the root (a write in progress)."""
    return any(".tmp" in rel and f"model={model}" in rel and ".parquet" in rel and not rel.startswith("lookup/")
               for rel in (p.relative_to(root).as_posix() for p in root.rglob("*")))


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_readme_readers_count_what_the_api_counts_after_sigkills_and_compaction(tmp_path):
    root = tmp_path / "store"
    write_groups(root, [make_group(i, "seed-model", seed=i) for i in range(6)])
    server = StoreServer(root, env={"GRAFT_STORE_COMPACT_INTERVAL_S": "0"}).start()
    acknowledged: list[str] = []
    stop = threading.Event()

    def push_until_stopped():
        with StoreClient(server.url, retries=0) as client:
            batch = 0
            while not stop.is_set():
                groups = [make_group(1000 + batch * 40 + i, "pushed", step=batch, size=8, tokens=256) for i in range(40)]
                try:
                    client.push_groups(groups)
                except (StoreError, OSError):
                    return  # the server is gone
                acknowledged.extend(g.group_id for g in groups)
                batch += 1

    writer = subprocess.Popen([sys.executable, str(WRITER), str(root), "written", "1000", "40", str(tmp_path / "done.log")])
    pusher = threading.Thread(target=push_until_stopped)
    pusher.start()
    try:
        wait_for(lambda: len(acknowledged) >= 120, what="three acknowledged pushes")
        # SIGKILL both while they write: each has its temporary file open in <root>/.tmp/
        wait_for(lambda: writing(root, "written"), what="the writer writing")
        os.kill(writer.pid, signal.SIGKILL)
        wait_for(lambda: writing(root, "pushed"), what="the server writing a push")
        server.kill()
        stop.set()
        pusher.join(60)
        writer.wait(60)
        assert writing(root, "written") or writing(root, "pushed"), "no partial file left: the kills came between writes"
        # the store is down: the folder holds only whole files, and the page's readers run
        assert all(p.name.startswith("part-") for p in (root / "rollouts").glob("*/*"))
        assert glob_rows(root) >= 8 * len(acknowledged)
        before_restart = readme_counts(root)
        assert before_restart["duckdb"] == before_restart["pyarrow"] == before_restart["duckdb sql"]
        assert before_restart["duckdb"]["pushed"] >= 8 * len(acknowledged)

        server.start()
        with StoreClient(server.url) as client:
            assert all(client.get_group(g) is not None for g in acknowledged)  # nothing acknowledged was lost
            wait_for(lambda: client.stats().total_rollouts == glob_rows(root), what="every whole file indexed")
            counts = readme_counts(root)
            assert counts["duckdb"] == counts["pyarrow"] == counts["duckdb sql"] == api_counts(client)
        server.stop()

        # compaction keeps the replaced shards 30 s for in-flight reads: a glob counts them twice, the manifest not
        for i in range(6):
            write_groups(root, [make_group(2000 + 10 * i + k, "seed-model", step=i, seed=i) for k in range(3)])
        server.env.update({"GRAFT_STORE_COMPACT_INTERVAL_S": "0.5", "GRAFT_STORE_COMPACT_MIN_FILES": "2",
                           "GRAFT_STORE_RETIRED_GRACE_S": "300"})
        server.start()
        with StoreClient(server.url) as client:
            wait_for(lambda: len(list((root / "rollouts" / "model=seed-model").glob("part-*"))) >= 8
                     and client.stats().files < len(list(root.glob("rollouts/*/part-*"))), what="a compaction")
            api = api_counts(client)
            assert glob_rows(root) > sum(api.values())  # the replaced shards are still in the folder
            counts = readme_counts(root)
            assert counts["duckdb"] == counts["pyarrow"] == counts["duckdb sql"] == api
            assert sum(pq.ParquetFile(f).metadata.num_rows for f in root.glob("rollouts/*/part-*")) > sum(api.values())
    finally:
        stop.set()
        pusher.join(60)
        if writer.poll() is None:
            writer.kill()
        server.stop()


def test_the_readmes_and_docs_links_and_doc_mentions_point_into_the_repository():
    pages = [README, *sorted((REPOSITORY / "docs").glob("*.md"))]
    assert "docs/ARCHITECTURE.md" in re.findall(r"\]\(([^)#\s]+)\)", README.read_text())
    missing = []
    for page in pages:
        text = page.read_text()
        targets = [t for t in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in t]
        mentioned = re.findall(r"((?:[\w.-]+/)*ARCHITECTURE\.md)", text) if page == README else []
        missing += [f"{page.name}: {t}" for t in targets + mentioned if not (page.parent / t).exists()]
    assert not missing, f"pages point to files the repository does not have: {missing}"


def test_docs_img_holds_only_images_a_page_shows():
    shown = {Path(t).name for page in [README, *(REPOSITORY / "docs").glob("*.md")]
             for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text()) if "img/" in t}
    held = sorted(p.name for p in (REPOSITORY / "docs" / "img").iterdir()) if (REPOSITORY / "docs" / "img").exists() else []
    assert set(held) <= shown, f"docs/img holds images no page shows: {sorted(set(held) - shown)}"
