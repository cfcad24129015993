"""A trainer started again where a run is: refused unless told to resume or overwrite; checkpoints pruned by the order
they were written; SIGTERM (docker stop) stops a real `graft-train` at a step boundary with its checkpoint written,
and `--resume` continues from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import torch
import yaml
from train_configs import make_config
from typer.testing import CliRunner

from graft.rollouts.files import latest_checkpoint, list_checkpoints
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer
from graft.trainer.checkpoint import checkpoints_dir, resumable, save_checkpoint
from graft.trainer.cli import app
from graft.trainer.loop import train

REPO = Path(__file__).resolve().parents[2]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def checkpoint_steps(run_dir: Path) -> list[int]:
    return [int(p.name.removeprefix("step_")) for p in list_checkpoints(checkpoints_dir(run_dir), resumable)]


def test_pruning_keeps_the_checkpoints_written_last(char_model, char_tokenizer, tmp_path):
    """keep_last=2 after steps 50, 100, 150 and then 50 again (a run started over): the new 50 stays, and is the newest."""
    optimizer = torch.optim.AdamW(char_model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for step in (50, 100, 150, 50):
        save_checkpoint(tmp_path, step, char_model, char_tokenizer, optimizer, scheduler, {"step": step}, keep_last=2)
    assert checkpoint_steps(tmp_path) == [150, 50]
    assert latest_checkpoint(checkpoints_dir(tmp_path), resumable).name == "step_000050"


@pytest.mark.slow
def test_a_fresh_start_where_a_run_is_is_refused(toy_world, tmp_path):
    cfg = make_config(toy_world, tmp_path / "run", None, method="grpo", steps=2, **{"checkpoint.every_steps": 1})
    run_dir = train(cfg)
    before = (read_metrics(run_dir), checkpoint_steps(run_dir))
    with pytest.raises(FileExistsError, match="--resume.*--overwrite"):
        train(cfg.model_copy(update={"steps": 1}))
    result = CliRunner().invoke(app, ["train", "--model", str(toy_world.learner_dir), "--dataset",
                                      str(toy_world.problems_path), "--method", "grpo", "--run-dir", str(run_dir)])
    assert result.exit_code == 2 and "--resume" in result.output and "--overwrite" in result.output, result.output
    assert (read_metrics(run_dir), checkpoint_steps(run_dir)) == before  # nothing of the run was touched
    # Told to overwrite: the old run's checkpoints and lines are gone, the new run's are there.
    train(cfg.model_copy(update={"steps": 1}), overwrite=True)
    assert [m["step"] for m in read_metrics(run_dir)] == [1] and checkpoint_steps(run_dir) == [1]


@pytest.mark.slow
def test_resume_without_a_checkpoint_starts_fresh_and_says_so(toy_world, tmp_path):
    """What the compose trainers do on their first start (`--resume` always): a run from step 1, and a log line."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(b'{"step": 1}\n')  # a run that died before its first checkpoint
    train(make_config(toy_world, run_dir, None, method="grpo", steps=1), resume=True)
    assert [m["step"] for m in read_metrics(run_dir)] == [1] and checkpoint_steps(run_dir) == [1]
    assert "no checkpoint in" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_sigterm_stops_at_a_step_boundary_and_resume_continues(toy_world, tmp_path):
    """SIGTERM to a real `graft-train` publishing to a store: it finishes the step, writes a checkpoint, pushes every
    sampled group and exits 0; `--resume` then runs the steps after that checkpoint."""
    with StoreServer(tmp_path / "store") as server:
        cfg = make_config(toy_world, tmp_path / "run", server.url, method="grpo", steps=50,
                          **{"peers.publish": True, "model.model_id": "sigterm"})
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        command = [sys.executable, "-m", "graft.trainer.cli", "train", "--config", str(config)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while not read_metrics(cfg.run_dir) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")[-3000:]
            proc.send_signal(signal.SIGTERM)
            output = proc.communicate(timeout=600)[0].decode(errors="replace")
        finally:
            proc.kill()
        assert proc.returncode == 0, output[-3000:]
        steps = [m["step"] for m in read_metrics(cfg.run_dir)]
        assert 1 <= len(steps) < 50 and steps == list(range(1, len(steps) + 1))
        assert checkpoint_steps(cfg.run_dir) == [len(steps)]
        with StoreClient(server.url) as client:
            published = {m.model_id: m.groups for m in client.stats().models}.get("sigterm", 0)
        assert published == len(steps) * 8, "the outbox was not flushed before exit"
        assert "SIGTERM" in (cfg.run_dir / "train.log").read_text()

        resumed = subprocess.run([*command, "--resume", "--steps", str(len(steps) + 1)], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(cfg.run_dir)] == list(range(1, len(steps) + 2))
    assert f"at step {len(steps)}" in (cfg.run_dir / "train.log").read_text()  # "resumed from ... at step N"
