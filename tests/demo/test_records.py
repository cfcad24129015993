"""demo.records: what every job and report records of the run, and the refusal of jobs cached under other code
(issue 60: the confirmatory run resumed from its cache while 36 files of its code changed, and no record said so)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from demo.jobs import Job, child_env, run_recorded
from demo.records import REPO_ROOT, first_party_files, git_state, host_state, invocation_record, job_record

WRITE = "import sys; open(sys.argv[1], 'w').write('{}')"


def _job(tmp_path: Path, name: str) -> Job:
    done = tmp_path / f"{name}.json"
    return Job(name=name, commands=[[sys.executable, "-c", WRITE, str(done)]], logs=[tmp_path / f"{name}.log"],
               done=[done], progress=lambda: 0.0, total=1.0)


def _finished_under(tmp_path: Path, name: str, files: dict[str, str] | None) -> Job:
    """A job found done, computed by code whose files had `files`' digests (None: no record, as before issue 60)."""
    job = _job(tmp_path, name)
    record = None if files is None else {**git_state(), "files": files, "host": host_state()}
    job.done[0].write_text(json.dumps({"record": record} if record else {}))
    return job


def test_a_job_records_its_code_commit_host_and_time():
    record = job_record("2026-12-06T00:00:00+00:00", {"demo/stats.py": "0" * 40})
    assert record["started"] == "2026-12-06T00:00:00+00:00" and record["finished"] >= record["started"]
    assert record["commit"] and record["clean"] in (True, False) and record["host"]["cpu"] and record["host"]["cores"]
    assert "demo/records.py" in record["files"]  # imported here: this test's own process ran it
    # a file that changed while the job ran keeps its start digest and is named
    assert record["files"]["demo/stats.py"] == "0" * 40 and "demo/stats.py" in record["changed_while_running"]


def test_a_resumed_run_refuses_jobs_cached_under_other_code_unless_told(tmp_path):
    now = {key: digest for key, digest in first_party_files().items() if key.startswith("demo/")}
    same = _finished_under(tmp_path, "same code", now)
    edited = _finished_under(tmp_path, "edited since", {**now, "demo/stats.py": "f" * 40})
    unrecorded = _finished_under(tmp_path, "no record", None)
    fresh = _job(tmp_path, "to run")
    invocation = invocation_record(child_env(), "test", ["test"])
    with pytest.raises(SystemExit) as refused:
        run_recorded([same, edited, unrecorded, fresh], 1, "test", child_env(), None, invocation, accept_cached_code=False)
    assert "edited since" in str(refused.value) and "demo/stats.py" in str(refused.value)
    assert "no record" in str(refused.value) and "same code" not in str(refused.value)
    assert not fresh.is_done()  # nothing ran
    _, record = run_recorded([same, edited, unrecorded, fresh], 1, "test", child_env(), None, invocation,
                             accept_cached_code=True)
    assert fresh.is_done() and record["jobs_ran"] == 1 and record["jobs_found_done"] == 3
    assert set(record["accepted_from_other_code"]) == {"edited since", "no record"}  # said in the report's record
    assert record["commit"] == git_state(REPO_ROOT)["commit"] and record["host"]["cpu"]
