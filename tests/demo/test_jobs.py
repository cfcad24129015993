"""demo.jobs.run_jobs: slots, dependencies, the order of jobs of different sizes, and failures, with real processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from demo.jobs import Job, child_env, run_jobs

TIMED = "import sys, time; t = time.time(); time.sleep(float(sys.argv[2])); open(sys.argv[1], 'w').write(f'{t} {time.time()}')"


def job(tmp_path: Path, name: str, seconds: float, slots: int = 1, deps: list[str] | None = None) -> Job:
    parts = [tmp_path / f"{name}-{i}.done" for i in range(slots)]
    return Job(name=name, commands=[[sys.executable, "-c", TIMED, str(p), str(seconds)] for p in parts],
               logs=[tmp_path / f"{name}-{i}.log" for i in range(slots)], done=parts, progress=lambda: 0.0, total=1.0,
               deps=deps or [])


def interval(tmp_path: Path, name: str) -> tuple[float, float]:
    start, end = map(float, (tmp_path / f"{name}-0.done").read_text().split())
    return start, end


def test_slots_dependencies_and_a_two_slot_job_is_not_starved(tmp_path):
    jobs = [job(tmp_path, "a", 0.8), job(tmp_path, "pair", 0.4, slots=2), job(tmp_path, "b", 0.2),
            job(tmp_path, "after_a", 0.2, deps=["a"])]
    timings = run_jobs(jobs, slots=2, desc="test", env=child_env())
    assert set(timings) == {"a", "pair", "b", "after_a"}
    a, pair, b, after_a = (interval(tmp_path, n) for n in ("a", "pair", "b", "after_a"))
    assert after_a[0] >= a[1]  # dependency
    assert pair[0] >= a[1]  # two slots: only once `a` has ended
    # `b` fits next to `a` but would keep the pair waiting (no job of two slots runs to make room): it waits too
    assert b[0] >= pair[0]
    # never more than two processes at once
    events = sorted([(s, 1) for s, _ in (a, b, after_a)] + [(e, -1) for _, e in (a, b, after_a)]
                    + [(pair[0], 2), (pair[1], -2)])
    running = 0
    for _, change in events:
        running += change
        assert running <= 2


def test_a_failed_job_stops_the_run_and_shows_its_log(tmp_path):
    bad = Job(name="bad", commands=[[sys.executable, "-c", "raise SystemExit('no such data set: x.jsonl')"]],
              logs=[tmp_path / "bad.log"], done=[tmp_path / "bad.done"], progress=lambda: 0.0, total=1.0)
    with pytest.raises(RuntimeError, match="job bad failed .*no such data set"):
        run_jobs([bad, job(tmp_path, "later", 0.1, deps=["bad"])], slots=2, desc="test", env=child_env())


def test_a_waiting_job_is_overtaken_while_one_as_big_runs(tmp_path):
    # Three slots, two pairs: while the first pair runs, the second waits for it, and the free slot runs `s`.
    jobs = [job(tmp_path, "pair1", 0.8, slots=2), job(tmp_path, "pair2", 0.2, slots=2), job(tmp_path, "s", 0.2)]
    run_jobs(jobs, slots=3, desc="test", env=child_env())
    pair1, pair2, s = (interval(tmp_path, n) for n in ("pair1", "pair2", "s"))
    assert s[1] <= pair1[1] and pair2[0] >= pair1[1]
