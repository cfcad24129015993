"""demo.jobs.run_jobs: slots, dependencies, the order of jobs of different sizes, and failures, with real processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from demo.jobs import CodeGuard, Job, child_env, run_jobs

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


EDIT = "import sys; open(sys.argv[1], 'w').write(sys.argv[2]); open(sys.argv[3], 'w').write('')"


def editing_job(tmp_path: Path, name: str, source: Path, text: str) -> Job:
    """A job that writes `text` into `source` (a merge in the checkout while the demo runs) and finishes."""
    done = tmp_path / f"{name}.done"
    return Job(name=name, commands=[[sys.executable, "-c", EDIT, str(source), text, str(done)]], logs=[tmp_path / f"{name}.log"],
               done=[done], progress=lambda: 0.0, total=1.0)


def test_no_job_starts_once_the_code_has_changed_and_the_files_are_named(tmp_path):
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    source = code / "pkg" / "loss.py"
    source.write_text("SCALE = 1\n")
    (code / "notes.txt").write_text("not code")
    guard = CodeGuard([code])
    assert guard.changed() == []
    jobs = [editing_job(tmp_path, "merge", source, "SCALE = 2\n"), job(tmp_path, "after", 0.1, deps=["merge"]),
            job(tmp_path, "other", 0.1, deps=["merge"])]
    with pytest.raises(RuntimeError, match=r"code changed while the demo ran \(.*pkg/loss\.py\); 2 jobs not started\. The 1 finished"):
        run_jobs(jobs, slots=1, desc="test", env=child_env(), guard=guard)
    assert (tmp_path / "merge.done").exists() and not (tmp_path / "after-0.done").exists()


def test_a_file_rewritten_with_the_same_text_or_a_non_python_file_changes_nothing(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    source = code / "loss.py"
    source.write_text("SCALE = 1\n")
    guard = CodeGuard([code])
    jobs = [editing_job(tmp_path, "touch", source, "SCALE = 1\n"), editing_job(tmp_path, "notes", code / "notes.txt", "x"),
            job(tmp_path, "after", 0.1, deps=["touch", "notes"])]
    run_jobs(jobs, slots=1, desc="test", env=child_env(), guard=guard)
    assert (tmp_path / "after-0.done").exists()
    (code / "new.py").write_text("")
    source.unlink()
    assert guard.changed() == [str(code / "loss.py"), str(code / "new.py")]


def test_the_demos_guard_watches_its_own_code_the_studies_and_the_installed_graft():
    roots = CodeGuard.of_checkout().roots
    assert [r.name for r in roots] == ["demo", "toy", "studies", "graft"] and all((r / "__init__.py").is_file() for r in roots)
