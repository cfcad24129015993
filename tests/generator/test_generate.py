"""`graft-generate` end to end on the tiny model: shards in a store root, push to a store server,
crash (SIGKILL) and restart, clean stop on SIGTERM, continuous mode picking up a new checkpoint."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graft.rollouts.datasets import load_problems
from graft.rollouts.groups import make_group_id
from graft.rollouts.models import default_model_revision
from graft.rollouts.stopping import StopFlag
from graft.schemas import ROLLOUT_ARROW_SCHEMA, table_to_groups
from graft.services.generator.config import GeneratorConfig
from graft.services.generator.generate import run_generator
from toy.task import sample_problems, write_problems_jsonl

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def generator_command(model: Path, dataset: Path, store: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "graft.services.generator.cli", "--model", str(model), "--model-id", "tiny",
            "--dataset", str(dataset), "--set", "prompt.template=raw", "--set", "group_size=4", "--set", "max_tokens=12",
            "--store", store, "--set", "scoring.workers=1", "--set", "progress=false", *extra]


def start(command: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def run(command: list[str], log: Path, timeout: float = 300) -> dict:
    proc = start(command, log)
    assert proc.wait(timeout) == 0, log.read_text()[-5000:]
    return json.loads(log.read_text().strip().splitlines()[-1])


def stored_rows(root: Path) -> list[dict]:
    shards = sorted((root / "rollouts" / "model=tiny").glob("part-*.parquet"))
    return [row for shard in shards for row in pq.read_table(shard).to_pylist()]


def wait_for(condition, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the generator exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_sigterm_then_sigkill_then_restart_stores_exactly_the_groups_asked_for(tiny_model_dir, tmp_path):
    dataset = write_problems_jsonl(sample_problems(24, seed=7), tmp_path / "toy.jsonl")
    root = tmp_path / "store"
    shards_dir = root / "rollouts" / "model=tiny"
    shard_count = lambda: len(list(shards_dir.glob("part-*.parquet")))  # noqa: E731
    command = generator_command(tiny_model_dir, dataset, str(root), "--set", "rounds=2", "--set", "prompts_per_batch=2", "--set", "seed=3")

    # 1. SIGTERM: the current batch is stored, then a clean exit.
    proc = start(command, tmp_path / "first.log")
    wait_for(lambda: shard_count() >= 1, 300, proc, "the first shard")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    first = json.loads((tmp_path / "first.log").read_text().strip().splitlines()[-1])
    assert 0 < first["groups"] < 48 and first["groups"] % 2 == 0  # whole batches only
    assert len(stored_rows(root)) == first["groups"] * 4

    # 2. SIGKILL mid-run: a crash.
    proc = start(command, tmp_path / "second.log")
    wait_for(lambda: shard_count() >= first["batches"] + 2, 300, proc, "two more shards")
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    before = {r["group_id"] for r in stored_rows(root)}
    assert first["groups"] < len(before) < 48, "the run was not interrupted mid-way"

    # 3. Restart: only the missing groups are sampled.
    summary = run(command, tmp_path / "third.log")
    assert summary["skipped_already_stored"] == len(before) and summary["groups"] == 48 - len(before)
    rows = stored_rows(root)
    revision = default_model_revision(tiny_model_dir)
    key = GeneratorConfig(model=str(tiny_model_dir), dataset=str(dataset), store=str(root), prompt={"template": "raw"}, group_size=4,
                          max_tokens=12).sampling_key()  # generator_command's settings
    expected = {make_group_id("tiny", revision, 0, p.prompt_id, r, key) for p in load_problems(str(dataset)) for r in range(2)}
    assert len(rows) == 48 * 4 and {r["group_id"] for r in rows} == expected  # none lost, none twice
    assert len({r["rollout_id"] for r in rows}) == len(rows)
    assert {r["model_revision"] for r in rows} == {revision} and {r["policy_step"] for r in rows} == {0}
    assert len(table_to_groups(pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA), validate=True)) == 48
    assert not list(shards_dir.glob(".tmp-*"))
    problems_files = list((root / "prompts" / "dataset=toy").glob("part-*.parquet"))
    assert {p["prompt_id"] for f in problems_files for p in pq.read_table(f).to_pylist()} == \
        {p.prompt_id for p in load_problems(str(dataset))}


def test_continuous_mode_reloads_a_newer_checkpoint(tiny_model_dir, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="graft.generator")  # the CLI's level: the reload line must show there
    dataset = write_problems_jsonl(sample_problems(8, seed=7), tmp_path / "toy.jsonl")
    root, watch = tmp_path / "store", tmp_path / "checkpoints"
    shutil.copytree(tiny_model_dir, watch / "step_000001")
    config = GeneratorConfig(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), prompt={"template": "raw"}, group_size=4,
                             max_tokens=12, store=str(root), scoring={"workers": 1}, progress=False, continuous=True,
                             watch_dir=str(watch), prompts_per_batch=4, idle_sleep_s=0.2)
    stop = StopFlag()
    result: list = []
    # In a thread, as a sampling service inside another process would run it; stopped through its flag.
    thread = threading.Thread(target=lambda: result.append(run_generator(config, stop)))
    thread.start()
    try:
        wait_for(lambda: any(r["policy_step"] == 1 for r in stored_rows(root)), 300, what="groups of step 1")
        # The trainer publishes a checkpoint by renaming a finished folder into place.
        shutil.copytree(tiny_model_dir, watch / ".tmp-step_000002")
        os.rename(watch / ".tmp-step_000002", watch / "step_000002")
        wait_for(lambda: any(r["policy_step"] == 2 for r in stored_rows(root)), 300, what="groups of step 2")
    finally:
        stop.requested = True
        thread.join(120)
    assert not thread.is_alive() and result, "the generator did not stop"
    assert result[0].reloads == 1
    reloads = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert reloads == [f"reloaded the newer checkpoint {watch / 'step_000002'}: policy step 1 -> 2"], reloads
    rows = stored_rows(root)
    assert {r["policy_step"] for r in rows} == {1, 2}
    assert len({r["group_id"] for r in rows}) * 4 == len(rows)


def test_push_to_a_store_server_and_resume_through_its_api(tiny_model_dir, tmp_path):
    from graft.services.store_api.http.client import StoreClient
    from graft.services.store_api.http.testing import StoreServer

    dataset = write_problems_jsonl(sample_problems(6, seed=7), tmp_path / "toy.jsonl")
    with StoreServer(tmp_path / "store", token="secret") as server:
        config = GeneratorConfig(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), prompt={"template": "raw"},
                                 group_size=4, max_tokens=12, store=server.url, store_token="secret", scoring={"workers": 1},
                                 progress=False, prompts_per_batch=4)
        first = run_generator(config)
        assert first.groups == 6 and first.batches == 2
        with StoreClient(server.url, token="secret") as client:
            rows = [row for page in client.iter_rollouts(model="tiny") for row in page.to_pylist()]
        assert len(rows) == 6 * 4 and len({r["group_id"] for r in rows}) == 6
        second = run_generator(config)
        assert second.groups == 0 and second.skipped_already_stored == 6


def test_commit_to_a_lake_and_resume_from_it(tiny_model_dir, tmp_path, monkeypatch):
    """A lake target (SQLite catalog, data on a local path): one transaction per batch, resumable from the lake."""
    from graft.services.store_api.lake.config import LakeConfig
    from graft.services.store_api.lake.lake import Lake

    dataset = write_problems_jsonl(sample_problems(6, seed=7), tmp_path / "toy.jsonl")
    catalog = f"ducklake:sqlite:{tmp_path / 'catalog.sqlite'}"
    monkeypatch.setenv("GRAFT_LAKE_DATA_PATH", f"{tmp_path / 'lake'}/")
    config = GeneratorConfig(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), prompt={"template": "raw"},
                             group_size=4, max_tokens=12, store=catalog, scoring={"workers": 1}, progress=False,
                             prompts_per_batch=4)
    first = run_generator(config)
    assert first.groups == 6 and first.batches == 2
    with Lake(LakeConfig(catalog=catalog), create=False) as lake:
        snapshot = lake.reading.snapshot().id
        rows = lake.reading.rollouts_between(-1, snapshot)
        assert rows.num_rows == 6 * 4 and len(set(rows.column("group_id").to_pylist())) == 6
        assert len(set(rows.column("snapshot_id").to_pylist())) == 2  # one snapshot per batch
        assert lake.reading.problems_between(-1, snapshot).num_rows == 6
    second = run_generator(config)
    assert second.groups == 0 and second.skipped_already_stored == 6


def test_bad_input_gets_a_clear_error(tiny_model_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    missing = subprocess.run(generator_command(tiny_model_dir, tmp_path / "nope.jsonl", str(tmp_path / "s")),
                             cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "nope.jsonl" in missing.stderr
    config = tmp_path / "gen.yaml"
    config.write_text("model: x\ndataset: y\nstore: z\ngroup_sizes: 3\n")
    bad = subprocess.run([sys.executable, "-m", "graft.services.generator.cli", "--config", str(config)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "group_sizes" in bad.stderr


def test_continuous_mode_keeps_its_batch_through_a_store_outage(tiny_model_dir, tmp_path, caplog):
    """The store server stops mid-run (far longer than the client's own retries) and starts again on its port: the
    continuous generator keeps the batch it sampled, retries with a growing pause, and no group is lost."""

    from graft.services.store_api.http.client import StoreClient
    from graft.services.store_api.http.testing import StoreServer

    caplog.set_level(logging.WARNING, logger="graft.generator")
    dataset = write_problems_jsonl(sample_problems(8, seed=7), tmp_path / "toy.jsonl")
    server = StoreServer(tmp_path / "store").start()

    def stored_ids() -> set[str]:
        with StoreClient(server.url) as client:
            return {g for page in client.iter_rollouts(model="tiny") for g in page.column("group_id").to_pylist()}

    config = GeneratorConfig(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), prompt={"template": "raw"}, group_size=4,
                             max_tokens=12, store=server.url, scoring={"workers": 1}, progress=False, continuous=True,
                             prompts_per_batch=2, idle_sleep_s=0.2)
    stop, result, failure = StopFlag(), [], []

    def generate():
        try:
            result.append(run_generator(config, stop))
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            failure.append(error)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        wait_for(lambda: len(stored_ids()) >= 2 or failure, 300, what="the first batch in the store")
        server.stop()
        wait_for(lambda: failure or any("kept" in r.getMessage() for r in caplog.records), 300, what="a failed write")
        time.sleep(3)  # well past the client's 3 retries at 0.2 s
        assert not failure, f"the generator gave up during the outage: {failure[0]!r}"
        server.start()
        during = len(stored_ids())
        wait_for(lambda: len(stored_ids()) >= during + 4 or failure, 300, what="batches after the outage")
    finally:
        stop.requested = True
        thread.join(300)
        ids = stored_ids() if server.process and server.process.poll() is None else set()
        server.stop()
    assert not failure, f"the generator gave up: {failure[0]!r}"
    assert not thread.is_alive() and result, "the generator did not stop"
    stats = result[0]
    assert stats.store_retries >= 1
    assert len(ids) == stats.groups == 2 * stats.batches  # every sampled batch stored, once


def test_continuous_mode_forgets_the_group_ids_of_finished_rounds(tiny_model_dir, tmp_path):
    """The ids of groups already stored are asked per round; a finished round's are never asked again, and a
    continuous run must not keep them all."""
    dataset = write_problems_jsonl(sample_problems(2, seed=7), tmp_path / "toy.jsonl")
    config = GeneratorConfig(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), prompt={"template": "raw"}, group_size=2,
                             max_tokens=4, store=str(tmp_path / "store"), scoring={"workers": 1}, progress=False, continuous=True,
                             prompts_per_batch=2, max_batches=4, idle_sleep_s=0.2)
    stats = run_generator(config)
    assert stats.batches == 4 and len(stored_rows(tmp_path / "store")) == 4 * 2 * 2  # 4 rounds of 2 prompts
    assert stats.stored_ids_held <= 2  # one round's ids at most, not all 8


def test_the_group_ids_hold_every_setting_that_changes_what_is_sampled():
    """The resume key: each prompt, sampling and scoring setting changes it; backend, dtype, seed and batch sizes,
    which change which samples are drawn but not their distribution, do not."""
    base = dict(model="m", dataset="d", store="s", prompt={"template": "auto"})
    key = GeneratorConfig(**base).sampling_key()
    changed = {"prompt": {"few_shot": 3}, "prompt.template": {"template": "plain"}, "prompt.instruction": {"instruction": "Box it."},
               "prompt.system_prompt": {"system_prompt": "Be brief."}, "answer_field": "solution", "group_size": 4,
               "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_tokens": 128, "std_normalize": False}
    for name, value in changed.items():
        assert GeneratorConfig(**{**base, name.split(".")[0]: value}).sampling_key() != key, name
    for name, value in {"sampler": {"backend": "vllm", "dtype": "bfloat16"}, "seed": 5, "sampler.batch_size": {"batch_size": 8},
                        "prompts_per_batch": 2, "scoring": {"workers": 1}, "top_k": 0}.items():  # top_k 0: no cut, as None
        assert GeneratorConfig(**{**base, name.split(".")[0]: value}).sampling_key() == key, name


def test_a_rerun_with_other_settings_is_refused_and_names_the_flag_that_starts_anew(tiny_model_dir, tmp_path):
    """The issue's case: zero-shot groups stored, then a 3-shot run of the same model over the same prompts. It used to
    skip them as its own; now it stores nothing and names --model-id, under which the 3-shot run goes ahead."""
    dataset = write_problems_jsonl(sample_problems(4, seed=7), tmp_path / "toy.jsonl")
    root = tmp_path / "store"
    settings = dict(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), group_size=2, max_tokens=8,
                    store=str(root), scoring={"workers": 1}, progress=False)
    assert run_generator(GeneratorConfig(**settings)).groups == 4
    before = stored_rows(root)
    with pytest.raises(ValueError, match=r"other settings sampled.*--model-id tiny-"):
        run_generator(GeneratorConfig(**settings, prompt={"few_shot": 3}))
    assert stored_rows(root) == before  # nothing sampled, nothing skipped as if it were this run's
    again = run_generator(GeneratorConfig(**settings))  # the first run's settings resume it: all there
    assert again.groups == 0 and again.skipped_already_stored == 4
    other = run_generator(GeneratorConfig(**{**settings, "model_id": "tiny-fs3"}, prompt={"few_shot": 3}))
    assert other.groups == 4 and other.skipped_already_stored == 0
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")  # the CLI: one line, exit 2, no traceback
    cli = subprocess.run([sys.executable, "-m", "graft.services.generator.cli", "--model", str(tiny_model_dir), "--model-id",
                          "tiny", "--dataset", str(dataset), "--set", "group_size=2", "--set", "max_tokens=16", "--store", str(root),
                          "--set", "scoring.workers=1", "--set", "progress=false"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 2 and "--model-id tiny-" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
    assert len(stored_rows(root)) == len(before)


def test_a_summary_says_why_the_success_rate_is_what_it_is(tiny_model_dir, tmp_path):
    """no_boxed_answer and truncated beside success_rate: the toy model answers `a+b=` with digits, never boxed."""
    dataset = write_problems_jsonl(sample_problems(3, seed=7), tmp_path / "toy.jsonl")
    summary = run(generator_command(tiny_model_dir, dataset, str(tmp_path / "store"), "--set", "max_tokens=3"),
                  tmp_path / "run.log")
    rows = stored_rows(tmp_path / "store")
    assert summary["no_boxed_answer"] == sum(r["extracted_answer"] is None for r in rows) == 12
    assert summary["truncated"] == sum(r["finish_reason"] == "length" for r in rows) > 0
    assert summary["success_rate"] == 0.0 and summary["gold_unparsed"] == 0


def test_dry_run_checks_the_inputs_and_shows_the_prompt_as_the_model_sees_it(tiny_model_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")
    raw = tmp_path / "raw.jsonl"  # GSM8K as published: question, and an answer ending in '#### 7'
    raw.write_text(json.dumps({"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"}) + "\n")

    def dry(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "graft.services.generator.cli", "--store", str(tmp_path / "s"), "--dry-run",
                               *flags], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)

    missing = dry("--model", str(tmp_path / "no-model"), "--dataset", str(raw))
    assert missing.returncode == 2 and "no-model does not exist" in missing.stderr
    unnamed = dry("--model", str(tiny_model_dir), "--dataset", str(raw))
    assert unnamed.returncode == 2 and "--set problem_field=question" in unnamed.stderr and "Traceback" not in unnamed.stderr
    assert len(unnamed.stderr.strip().splitlines()) == 2, unnamed.stderr  # the heading and one line per input
    shown = dry("--model", str(tiny_model_dir), "--dataset", str(raw), "--set", "problem_field=question",
                "--set", "prompt.system_prompt=You are a careful tutor.", "--set", "prompt.instruction=Box the answer.")
    assert shown.returncode == 0, shown.stderr
    prompt = shown.stdout.split("as the model sees it")[1]
    assert "You are a careful tutor." in prompt and "Tom has 3 apples" in prompt and "Box the answer." in prompt
    assert "its gold answer, as the scorer reads it: 7" in shown.stdout
    assert not (tmp_path / "s").exists()  # a dry run writes nothing


@pytest.mark.parametrize("writer, refused", [("graft-train:cotrain-peer", False), ("trl:run", False), ("otherhost-41", True)])
def test_a_trainers_own_groups_under_the_model_id_are_no_earlier_sampling_of_the_generator(tiny_model_dir, tmp_path,
                                                                                              writer, refused):
    """docker-compose's cotrain profile: a generator follows a co-trainer's checkpoints under the trainer's model id,
    and the trainer publishes its own groups (policy step 0, the same revision) as it trains. They are the trainer's
    samples, not an earlier run of this generator with other settings: the generator starts beside them. A group another
    generator wrote is still refused (the compose test saw the generator fail once at start and restart)."""
    from graft.schemas import RolloutGroup
    from graft.services.store_api.local.shards import write_groups

    dataset = write_problems_jsonl(sample_problems(4, seed=7), tmp_path / "toy.jsonl")
    settings = dict(model=str(tiny_model_dir), model_id="tiny", dataset=str(dataset), group_size=2, max_tokens=8,
                    scoring={"workers": 1}, progress=False)
    first = tmp_path / "first"
    run_generator(GeneratorConfig(**settings, store=str(first)))
    groups = [g for path in sorted((first / "rollouts").rglob("*.parquet")) for g in table_to_groups(pq.read_table(path))]
    root = tmp_path / "store"  # the same prompts, model, revision and step under other group ids, written by `writer`
    write_groups(root, [RolloutGroup(rollouts=[r.model_copy(update={"group_id": "f" * 31 + str(i), "rollout_id": f"{'f' * 31}{i}-{k}",
                                                                    "generator_id": writer})
                                               for k, r in enumerate(g.rollouts)]) for i, g in enumerate(groups)])
    if refused:
        with pytest.raises(ValueError, match="other settings sampled"):
            run_generator(GeneratorConfig(**settings, store=str(root)))
    else:
        assert run_generator(GeneratorConfig(**settings, store=str(root))).groups == 4


def test_a_trainers_generator_id_names_the_trainer_and_the_run():
    """The ids the three trainers give their published groups are the ones stored_groups tells apart, and no other
    writer's id passes for one (the split is at the first colon: a run name may hold more)."""
    from graft.schemas import TRAINERS, is_trainers_own, trainer_generator_id

    assert [trainer_generator_id(t, "run:1") for t in TRAINERS] == ["graft-train:run:1", "trl:run:1", "verl:run:1"]
    assert all(is_trainers_own(trainer_generator_id(t, "r")) for t in TRAINERS)
    assert not any(map(is_trainers_own, ["", None, "otherhost-41", "trl", "trlx:run", "graft-generate:trl:run"]))
    with pytest.raises(ValueError, match="none of the trainers"):
        trainer_generator_id("openrlhf", "run")
