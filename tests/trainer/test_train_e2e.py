"""The real path end to end: tiny models, a real store server (uvicorn on loopback), math-verify."""

from __future__ import annotations

import contextlib
import math
import shutil

import orjson
import pytest
import torch
import yaml
from safetensors.torch import load_file
from train_configs import make_config

from graft.rollouts.files import latest_checkpoint
from graft.services.store_api.http.client import StoreClient
from graft.services.store_api.http.testing import StoreServer
from graft.trainer.checkpoint import load_trainer_state, resumable
from graft.trainer.loop import train
from graft.trainer.metrics import METRIC_KEYS

pytestmark = pytest.mark.slow
DETERMINISTIC_KEYS = [
    k for k in METRIC_KEYS if k not in ("step_time_s", "store_wait_s")
] + ["frac_mixed", "grad_norm", "anchor_nll", "reward_previously_grafted"]


@pytest.fixture(scope="module")
def store(toy_world):
    with StoreServer(toy_world.store_root) as server:
        yield server


def read_metrics(run_dir):
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def weights(path):
    return load_file(str(path / "model.safetensors"))


def same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_graft_through_a_real_store_grafts_and_trains(toy_world, store, tmp_path):
    run_dir = train(make_config(toy_world, tmp_path / "graft", store.url, steps=3))
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert set(METRIC_KEYS) <= set(m), set(METRIC_KEYS) - set(m)
        # the learner fails the peer's family, where the peer stored informative groups: grafts happen
        assert m["frac_all_fail"] > 0 and m["peer_hit_rate"] > 0 and m["frac_grafted"] > 0
        assert m["peer_rollouts_consumed"] > 0 and m["projection_spans"] == m["peer_rollouts_consumed"]
        assert 0 < m["compat_weight_mean"] <= 1 and m["log_rho_p10"] <= m["log_rho_p50"] <= m["log_rho_p90"]
        assert 0 < m["behaviour_ratio_p50"] <= 2.0  # b is truncated at C = 2
        assert math.isnan(m["behaviour_ratio_hardest_p50"]) or 0 < m["behaviour_ratio_hardest_p50"] <= 2.0
        assert m["rollouts_generated"] == 8 * 4 and m["store_lookup_failures"] == 0
        assert m["groups_no_peer_tokenizer"] == 0 and m["same_tokenizer_id_mismatch"] == 0 and m["dropped_peer_decode"] == 0
    assert metrics[-1]["peer_rollouts_consumed_total"] == sum(m["peer_rollouts_consumed"] for m in metrics)
    # what each step grafted, by prompt and stored group, and how many of its rows carried a gradient
    with StoreClient(store.url) as client:
        for m in metrics:
            assert len(m["grafted_groups"]) == round(m["frac_grafted"] * 8) > 0
            for grafted in m["grafted_groups"]:
                group = client.get_group(grafted["group_id"])
                assert (group.prompt_id, group.model_id) == (grafted["prompt_id"], grafted["model_id"]) == \
                    (grafted["prompt_id"], toy_world.peer_model_id)
            assert 0 < m["rows_with_signal"] <= m["rows"]
    log_lines = [line for line in (run_dir / "train.log").read_text().splitlines() if ": step " in line]
    assert [line.split("step ")[1].split(":")[0] for line in log_lines] == ["1", "2", "3"]
    assert f"{len(metrics[0]['grafted_groups'])} group(s) grafted" in log_lines[0]
    assert f"{metrics[0]['rows']} rows trained on, {metrics[0]['rows_with_signal']} with a non-zero advantage" in log_lines[0]
    before, after = weights(toy_world.learner_dir), weights(run_dir / "checkpoints" / "step_000003")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (run_dir / "checkpoints" / "step_000003" / "tokenizer.json").exists()


def test_graft_without_peers_is_grpo(toy_world, tmp_path):
    """With no store to reach, every all-fail group is skipped: the run is exactly GRPO (and never stops)."""
    dead_url = "http://127.0.0.1:9"  # discard port: nothing listens
    graft_dir = train(make_config(toy_world, tmp_path / "graft", dead_url, steps=2))
    grpo_dir = train(make_config(toy_world, tmp_path / "grpo", dead_url, steps=2, method="grpo"))
    graft, grpo = read_metrics(graft_dir), read_metrics(grpo_dir)
    assert all(m["frac_grafted"] == 0 and m["store_lookup_failures"] + m["store_lookups_skipped_backoff"] >= 1 for m in graft)
    assert all(m["groups_no_peer"] == m["groups_no_peer_unanswered"] > 0 for m in graft)  # the store never answered
    assert [m["loss"] for m in graft] == [m["loss"] for m in grpo]
    a, b = weights(graft_dir / "checkpoints" / "step_000002"), weights(grpo_dir / "checkpoints" / "step_000002")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_store_killed_mid_run_training_continues_and_grafting_resumes(toy_world, tmp_path):
    # A store of its own over a copy of the shards (the module's server holds the original index).
    root = shutil.copytree(toy_world.store_root, tmp_path / "store", ignore=shutil.ignore_patterns("index.duckdb*", "logs"))
    server = StoreServer(root).start()
    events = []

    def on_step(metrics):
        if metrics["step"] == 2:
            server.kill()  # a crash, not a clean shutdown
            events.append("killed")
        if metrics["step"] == 4:
            server.start()
            events.append("restarted")

    try:
        run_dir = train(make_config(toy_world, tmp_path / "run", server.url, steps=6), on_step=on_step)
    finally:
        server.stop()
    metrics = read_metrics(run_dir)
    assert events == ["killed", "restarted"] and [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["frac_grafted"] > 0 for m in metrics[:2])
    down = metrics[2:4]
    assert all(m["frac_grafted"] == 0 and m["peer_hit_rate"] == 0 for m in down)
    assert sum(m["store_lookup_failures"] + m["store_lookups_skipped_backoff"] for m in down) >= 2
    assert any(m["frac_grafted"] > 0 for m in metrics[4:])


def test_resume_reproduces_the_next_step(toy_world, store, tmp_path):
    full = train(make_config(toy_world, tmp_path / "full", store.url, steps=3, **{
        "checkpoint.every_steps": 2, "checkpoint.optimizer_in_newest_only": True}))
    part_cfg = make_config(toy_world, tmp_path / "part", store.url, steps=2)
    train(part_cfg)
    resumed = train(part_cfg.model_copy(update={"steps": 3}), resume=True)
    full_metrics, resumed_metrics = read_metrics(full), read_metrics(resumed)
    assert [m["step"] for m in resumed_metrics] == [1, 2, 3]
    for key in DETERMINISTIC_KEYS:
        assert same(full_metrics[2].get(key), resumed_metrics[2].get(key)), key
    a, b = weights(full / "checkpoints" / "step_000003"), weights(resumed / "checkpoints" / "step_000003")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the run's config as it started is kept; the resumed one beside it, the change named in the log
    assert yaml.safe_load((resumed / "config.yaml").read_text())["steps"] == 2
    assert yaml.safe_load((resumed / "config.resumed_at_000002.yaml").read_text())["steps"] == 3
    assert "steps: 2 -> 3" in (resumed / "train.log").read_text()
    # checkpoint.optimizer_in_newest_only: only the newest checkpoint keeps the optimizer state, the older one its
    # weights; by default every kept checkpoint can be resumed
    older, newest = full / "checkpoints" / "step_000002", full / "checkpoints" / "step_000003"
    assert "optimizer" not in load_trainer_state(older) and "optimizer" in load_trainer_state(newest)
    assert latest_checkpoint(full / "checkpoints", resumable) == newest and (older / "model.safetensors").exists()
    assert "optimizer" in load_trainer_state(resumed / "checkpoints" / "step_000002")
    shutil.rmtree(newest)
    with pytest.raises(ValueError, match="keeps no optimizer state"):
        train(make_config(toy_world, full, store.url, steps=3), resume=True)


def test_one_forward_serves_as_pi_old_when_one_update_per_step(toy_world, store, tmp_path):
    """One epoch, one mini-batch, one micro-batch: the update's forward, detached, is pi_old (no second
    pass). Micro-batches of 5 force the separate no-grad pass: the same weights and weights w, b follow."""
    overrides = {"steps": 2, "checkpoint.every_steps": 2}
    one = train(make_config(toy_world, tmp_path / "one", store.url, **overrides))
    two = train(make_config(toy_world, tmp_path / "two", store.url, **overrides, **{"optim.micro_batch_size": 5}))
    for a, b in zip(read_metrics(one), read_metrics(two)):
        assert a["frac_grafted"] > 0 and a["reward_mean"] == b["reward_mean"]
        for key in ("loss", "compat_weight_mean", "behaviour_ratio_p50", "ratio_mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    a, b = weights(one / "checkpoints" / "step_000002"), weights(two / "checkpoints" / "step_000002")
    # Summation order differs (one micro-batch or several); Adam turns that noise into ~1e-6 (lr is 2e-3).
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


def test_bfloat16_trains_on_float32_master_weights(toy_world, store, tmp_path):
    """model.dtype bfloat16 runs the forward passes under autocast and keeps float32 parameters: at the GPU configs'
    lr of 1e-6, bfloat16 parameters would take almost no update (it rounds away: ~1% of them moved)."""
    start = weights(toy_world.learner_dir)
    run_dir = train(make_config(toy_world, tmp_path / "bf16", store.url, steps=1, **{
        "model.dtype": "bfloat16", "optim.lr": 1e-6, "checkpoint.every_steps": 1}))
    (m,) = read_metrics(run_dir)
    assert m["frac_grafted"] > 0 and math.isfinite(m["loss"]) and m["optimizer_updates"] == 1
    after = weights(run_dir / "checkpoints" / "step_000001")
    assert all(t.dtype == torch.float32 for t in after.values())
    changed = sum(int((after[k] != start[k]).sum()) for k in start) / sum(t.numel() for t in start.values())
    assert changed > 0.5, changed


@pytest.mark.parametrize("overrides", [
    {"graft.union_all_success": True, "store.groups_per_prompt": 4},
    {"graft.token_is": "none", "graft.group_normalized_weight": True, "graft.log_rho_min": -1.0},
    {"graft.token_is": "luffy", "graft.peer_negative_scale": 0.0},
    {"ppo.advantage": "dr_grpo", "ppo.loss_agg": "seq-mean-token-mean", "ppo.kl_beta": 0.1, "graft.kl_on_peer": True},
    {"optim.skip_zero_advantage": True, "graft.token_is": "tis"},
    {"ppo.loss_agg": "seq-mean-token-sum-norm", "optim.mini_batch_prompts": 4, "optim.micro_batch_size": 5,
     "optim.ppo_epochs": 2, "graft.max_peer_policy_lag": 5, "graft.max_grafted_fraction": 0.25},
])
def test_options_run_on_the_same_code_path(toy_world, store, tmp_path, overrides):
    run_dir = train(make_config(toy_world, tmp_path / "run", store.url, steps=1, **overrides))
    (m,) = read_metrics(run_dir)
    assert m["frac_grafted"] > 0 and math.isfinite(m["loss"]) and m["optimizer_updates"] >= 1
    if overrides.get("graft.max_grafted_fraction") == 0.25:
        assert m["frac_grafted"] <= 0.25 and m["optimizer_updates"] == 4  # 2 epochs x 2 mini-batches
    if "ppo.kl_beta" in overrides:
        assert m["kl"] >= 0


def test_peer_groups_without_their_tokenizer_are_refused_with_one_warning(toy_world, store, tmp_path):
    """No tokenizer for the peer's tokenizer_id: its groups are refused at the gate (counted), with one warning
    naming the id and the setting, never grafted with a made-up mu~. The map {id: dir} finds it; the uniform
    projection grafts only when opted in."""
    from graft.rollouts.models import load_tokenizer, tokenizer_fingerprint

    run_dir = train(make_config(toy_world, tmp_path / "none", store.url, steps=3, **{"graft.peer_tokenizers": []}))
    metrics = read_metrics(run_dir)
    for m in metrics:
        assert m["frac_grafted"] == 0 and m["peer_rollouts_consumed"] == 0 and m["peer_hit_rate"] > 0
        assert m["groups_no_peer_tokenizer"] > 0 and m["projection_uniform"] == 0
        assert m["frac_skipped_no_signal"] * 8 >= m["groups_no_peer_tokenizer"]
    peer_tokenizer_id = tokenizer_fingerprint(load_tokenizer(toy_world.peer_dir))
    warnings = [line for line in (run_dir / "train.log").read_text().splitlines() if "has no tokenizer" in line]
    assert len(warnings) == 1, warnings  # one per tokenizer id, not one per step
    assert peer_tokenizer_id in warnings[0] and "graft.peer_tokenizers" in warnings[0] and "WARNING" in warnings[0]

    mapped = read_metrics(train(make_config(toy_world, tmp_path / "mapped", store.url, steps=1, **{
        "graft.peer_tokenizers": {peer_tokenizer_id: str(toy_world.peer_dir)}})))
    assert mapped[0]["frac_grafted"] > 0 and mapped[0]["groups_no_peer_tokenizer"] == 0
    assert mapped[0]["projection_spans"] == mapped[0]["peer_rollouts_consumed"] > 0

    uniform = read_metrics(train(make_config(toy_world, tmp_path / "uniform", store.url, steps=1, **{
        "graft.peer_tokenizers": [], "graft.uniform_projection": True})))
    assert uniform[0]["frac_grafted"] > 0 and uniform[0]["groups_no_peer_tokenizer"] == 0
    assert uniform[0]["projection_uniform"] == uniform[0]["peer_rollouts_consumed"] > 0


def test_kl_reference_is_taken_at_the_rollout_temperature(toy_world, store, tmp_path):
    """Before the first update the policy is the reference: at T = 0.7 the KL must be 0 (a reference at T = 1
    against a policy at T = 0.7 gives a KL of a few hundredths)."""
    run_dir = train(make_config(toy_world, tmp_path / "kl", store.url, steps=1, **{
        "rollout.temperature": 0.7, "ppo.kl_beta": 0.5, "graft.kl_on_peer": True}))
    (m,) = read_metrics(run_dir)
    assert m["frac_grafted"] > 0 and m["optimizer_updates"] == 1
    assert abs(m["kl"]) < 1e-6, m["kl"]


def test_group_normalized_weight_does_not_depend_on_skip_zero_advantage(toy_world, store, tmp_path):
    """Centring a grafted group's advantages under its weights takes every row's w, whatever its advantage before
    centring. optim.skip_zero_advantage is a speed switch: the update must be the same with it or without it."""
    # centring leaves the tokens a group shares a gradient of float noise, which Adam's default eps would turn into
    # full steps of either sign: a larger eps keeps the comparison about the real gradient
    overrides = {"steps": 1, "checkpoint.every_steps": 1, "graft.group_normalized_weight": True, "optim.adam_eps": 1e-3}
    plain = train(make_config(toy_world, tmp_path / "plain", store.url, **overrides))
    skipping = train(make_config(toy_world, tmp_path / "skip", store.url, **overrides, **{"optim.skip_zero_advantage": True}))
    (a,), (b,) = read_metrics(plain), read_metrics(skipping)
    assert a["frac_grafted"] > 0 and a["peer_rollouts_consumed"] == b["peer_rollouts_consumed"]
    for key in ("loss", "compat_weight_mean", "compat_weight_ess"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    wa, wb = weights(plain / "checkpoints" / "step_000001"), weights(skipping / "checkpoints" / "step_000001")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


@pytest.fixture
def malformed_store():
    """A server on loopback whose peer lookup answers 200 with an Arrow stream that lacks the rows' columns (the
    client's parsing raises KeyError: neither a StoreError nor an OSError)."""
    import http.server
    import threading

    import pyarrow as pa

    sink = pa.BufferOutputStream()
    table = pa.table({"prompt_id": ["0000000000000000"]})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    body = sink.getvalue().to_pybytes()
    lookups = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            lookups.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.apache.arrow.stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", lookups
    finally:
        server.shutdown()
        server.server_close()


def test_a_malformed_lookup_response_degrades_the_step_to_grpo(toy_world, malformed_store, tmp_path):
    url, lookups = malformed_store
    run_dir = train(make_config(toy_world, tmp_path / "run", url, steps=2))
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2] and lookups
    assert all(m["frac_grafted"] == 0 and m["peer_lookup_ok"] == 0.0 for m in metrics)
    assert sum(m["store_lookup_failures"] for m in metrics) >= 1
    assert "KeyError" in (run_dir / "train.log").read_text()


def test_dapo_refills_and_counts_rollouts(toy_world, tmp_path):
    run_dir = train(make_config(toy_world, tmp_path / "dapo", None, method="dapo", steps=2,
                                **{"dapo.max_generation_rounds": 3}))
    metrics = read_metrics(run_dir)
    for m in metrics:
        assert m["frac_grafted"] == 0 and m["peer_rollouts_consumed"] == 0 and 1 <= m["dapo_rounds"] <= 3
        assert m["rollouts_generated"] >= 32 and m["rollouts_generated"] % 4 == 0
        groups_generated = m["rollouts_generated"] // 4
        # kept = the mixed ones among everything generated (at most the prompt batch)
        assert m["dapo_groups_kept"] == min(8, round(m["frac_mixed"] * groups_generated))
    # the learner fails half the problems: a refill round was needed at least once
    assert any(m["dapo_rounds"] > 1 for m in metrics)


def test_anchor_evaluation_and_tensorboard(toy_world, store, tmp_path):
    run_dir = train(make_config(toy_world, tmp_path / "run", store.url, steps=2,
                                **{"anchor.dataset": str(toy_world.anchor_path), "anchor.prompts_per_step": 4,
                                   "logging.tensorboard": True, "eval.every_steps": 1, "eval.limit": 8,
                                   "eval.max_tokens": 16, "eval.benchmarks": {"toy": str(toy_world.problems_path)}}))
    metrics = read_metrics(run_dir)
    assert all(m["anchor_nll"] > 0 for m in metrics) and any((run_dir / "tb").iterdir())
    evals = [orjson.loads(line) for line in (run_dir / "eval.jsonl").read_bytes().splitlines()]
    assert [e["step"] for e in evals] == [1, 2]
    assert all(e["benchmarks"]["toy"]["problems"] == 8 and 0 <= e["benchmarks"]["toy"]["avg_at_k"] <= 1 for e in evals)
    # the learner's own family is half of the first 8 problems' population: greedy gets some right
    assert any(e["benchmarks"]["toy"]["avg_at_k"] > 0 for e in evals)


def test_step_rows_are_supervised_at_their_step(toy_world, tmp_path):
    """anchor.step_rows (the mutual study's control for GRAFT's loss form, issue 60): the rows of a step are trained on
    at that step, summed over the step's token-mean denominator, and pull the model toward them."""
    from graft.rollouts.models import load_model_and_tokenizer
    from graft.trainer.batch import collate, response_logprobs
    from graft.trainer.update import reference_rows

    problems = [orjson.loads(line) for line in toy_world.problems_path.read_bytes().splitlines()][:3]
    pairs = [(p["problem"], "\\boxed{" + p["answer"] + "}") for p in problems]
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_bytes(b"".join(orjson.dumps({"step": step, "problem": q, "completion": c}) + b"\n"
                                   for step in (0, 1) for q, c in pairs))
    plain = make_config(toy_world, tmp_path / "plain", None, steps=3, method="grpo", **{"store.url": None})
    with_rows = make_config(toy_world, tmp_path / "rows", None, steps=3, method="grpo",
                            **{"store.url": None, "anchor.step_rows": str(rows_path)})
    runs = {name: train(cfg) for name, cfg in (("plain", plain), ("rows", with_rows))}
    metrics = read_metrics(runs["rows"])
    assert [("step_rows_nll" in m) for m in metrics] == [True, True, False] and metrics[0]["step_rows_nll"] > 0
    assert all("step_rows_nll" not in m for m in read_metrics(runs["plain"]))

    def rows_logprob(run_dir) -> float:
        model, tokenizer = load_model_and_tokenizer(latest_checkpoint(run_dir / "checkpoints", resumable))
        learner = type("L", (), {"tokenizer": tokenizer, "end_token_id": tokenizer.eos_token_id})
        batch = collate(reference_rows(with_rows, learner, pairs), tokenizer.pad_token_id)
        with torch.no_grad():
            return float((response_logprobs(model, batch) * batch.mask).sum())

    assert rows_logprob(runs["rows"]) > rows_logprob(runs["plain"])
    with pytest.raises(ValueError, match="one optimizer update per step"):
        make_config(toy_world, tmp_path / "x", None, method="grpo", **{"store.url": None, "anchor.step_rows": str(rows_path),
                                                                        "optim.mini_batch_prompts": 4})


def test_cotraining_two_processes_through_one_store(toy_world, tmp_path):
    """Two graft-train processes, each the other's peer, through one (initially empty) store.

    Each step both publish their groups, then wait until the other's group of every prompt they failed is in
    the store: the wait ends on that condition, and peers.wait_s (300 s) is only a deadline against a
    co-trainer that died. So what each process trains on does not depend on the two processes' timing."""
    import subprocess
    import sys

    with StoreServer(tmp_path / "store") as server:
        common = ["--store-url", server.url, "--peers", "cotrain", "--steps", "3", "--dataset", str(toy_world.problems_path),
                  "--group-size", "4", "--prompts-per-step", "8", "--seed", "0",
                  "--set", "prompt.template=raw", "--set", "rollout.max_response_tokens=16",
                  "--set", "rollout.backend=hf", "--set", "rollout.scorer_workers=1", "--set", "optim.mini_batch_prompts=8",
                  "--set", "peers.wait_s=300", "--set", "logging.progress=false", "--set", "model.device=cpu",
                  "--set", "torch_threads=1"]
        runs = {
            "learner": ["--model", str(toy_world.learner_dir), "--run-dir", str(tmp_path / "a"), "--peer-models", "peer",
                        "--set", f"graft.peer_tokenizers=[{toy_world.peer_dir}]"],
            "peer": ["--model", str(toy_world.peer_dir), "--run-dir", str(tmp_path / "b"), "--peer-models", "learner",
                     "--set", f"graft.peer_tokenizers=[{toy_world.learner_dir}]"],
        }
        procs = {name: subprocess.Popen([sys.executable, "-m", "graft.trainer.cli", "train", *common, *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for name, args in runs.items()}
        outputs = {name: p.communicate(timeout=600)[0].decode(errors="replace") for name, p in procs.items()}
        for name, p in procs.items():
            assert p.returncode == 0, f"{name} failed:\n{outputs[name][-3000:]}"
        with StoreClient(server.url) as client:
            stats = {m.model_id: m for m in client.stats().models}
    assert stats["learner"].groups == 3 * 8 and stats["peer"].groups == 3 * 8
    learner, peer = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    for run in (learner, peer):
        assert [m["step"] for m in run] == [1, 2, 3]
        # the last push may land after the last metrics line (the exit flush sends it): the store holds all 24
        assert sum(m["store_groups_published"] for m in run) <= 24
        assert all(m["store_publish_failures"] == 0 and m["store_lookup_failures"] == 0 for m in run)
        assert all(m["groups_no_peer_tokenizer"] == 0 for m in run)
        assert all(m["cotrain_peer_silent_steps"] == 0 or math.isnan(m["cotrain_peer_silent_steps"]) for m in run)
    assert any(m["frac_grafted"] > 0 for m in learner)
    assert all(m["peer_group_age_steps"] == 0 for m in learner if m["frac_grafted"] > 0)  # the peer's group of the same step


def _all_fail_copy(group):
    """The group as if every rollout had failed (a peer that could not solve the prompt either)."""
    rollouts = [r.model_copy(update={"reward": 0.0, "correct": False, "advantage": 0.0, "extracted_answer": None})
                for r in group.rollouts]
    return group.model_copy(update={"rollouts": rollouts})


def test_the_metrics_say_why_an_all_fail_group_had_no_peer_group(toy_world, store, tmp_path):
    """Nothing stored, peers the run does not admit, only all-fail peer groups, only the learner's own groups: each
    all-fail group counted under its reason (groups_no_peer_<reason>, or groups_peer_uninformative), never all of
    them as groups_no_peer alike."""
    import pyarrow.parquet as pq

    from graft.schemas import table_to_groups
    from graft.services.store_api.local.manifest import live_files
    from graft.services.store_api.local.shards import write_groups

    stored = [g for path in live_files(toy_world.store_root)
              for g in table_to_groups(pq.read_table(toy_world.store_root / path))]
    write_groups(tmp_path / "all-fail", [_all_fail_copy(g) for g in stored])
    cases = {
        "empty": (tmp_path / "empty", {}, "groups_no_peer_nothing_stored"),
        "not admitted": (None, {"graft.peer_models": ["another-peer"]}, "groups_no_peer_peers_not_admitted"),
        "all-fail": (tmp_path / "all-fail", {}, "groups_peer_uninformative"),
        "own only": (None, {"model.model_id": toy_world.peer_model_id}, "groups_no_peer_only_learner"),
    }
    for name, (root, overrides, reason) in cases.items():  # root None: the module's store of the peer's groups
        with contextlib.nullcontext(store) if root is None else StoreServer(root) as server:
            run_dir = train(make_config(toy_world, tmp_path / name.replace(" ", "-"), server.url, steps=1, **overrides))
        m = read_metrics(run_dir)[0]
        all_fail = round(m["frac_all_fail"] * 8)
        assert all_fail > 0 and m["frac_grafted"] == 0, name
        assert m[reason] == all_fail, (name, {k: v for k, v in m.items() if k.startswith("groups_")})
        reasons = [k for k in m if k.startswith("groups_no_peer_") and k != "groups_no_peer_tokenizer"]
        assert sum(m[k] for k in reasons) == m["groups_no_peer"], name  # the reasons add up


def test_a_bfloat16_sampler_copy_samples_the_updated_policy(toy_world, store, tmp_path):
    """rollout.hf_sampler_copy: the hf sampler holds the policy in bfloat16 (no autocast around it) and takes every
    update's weights; its groups are the policy's (the store's informative ones are grafted as with autocast)."""
    from graft.trainer.learner import load_learner, make_sampler

    cfg = make_config(toy_world, tmp_path / "copy", store.url, steps=2, **{
        "model.dtype": "bfloat16", "rollout.hf_sampler_copy": True})
    learner = load_learner(cfg, None)
    sampler, uses_vllm = make_sampler(cfg, learner, cfg.model.path)
    assert not uses_vllm and sampler.model is learner.sampler_model
    assert {p.dtype for p in learner.sampler_model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        for weight in learner.hf_model.parameters():
            weight.add_(0.01)  # an update
    learner.sync_sampler_copy()
    for copy, weight in zip(learner.sampler_model.parameters(), learner.hf_model.parameters()):
        assert torch.equal(copy, weight.to(torch.bfloat16))
    metrics = read_metrics(train(cfg))
    assert [m["step"] for m in metrics] == [1, 2] and all("weight_sync_s" in m and m["frac_grafted"] > 0 for m in metrics)
    with pytest.raises(ValueError, match="hf_sampler_copy"):
        make_config(toy_world, tmp_path / "f32", store.url, **{"rollout.hf_sampler_copy": True})  # float32: nothing to copy


@pytest.mark.parametrize("stored", ["text_only_store_root", "raw_logprobs_store_root"])
def test_peer_groups_without_mu_graft_with_b_and_w_one_and_are_counted(stored, toy_world, request, tmp_path):
    """The toy peer's groups stored as a text-only source stores them (logprobs_mode 'none'), or with logprobs that
    are not their mu ('raw' at T = 0.7: schemas.mu_is_behaviour): graft-train grafts them with c = 1 (b = 1, w = 1),
    counts them (peer_rollouts_without_mu, projection_none, their clip fraction apart; the second kind also as
    peer_rollouts_mu_set_aside) and moves the weights; with graft.require_behaviour_logprobs the store leaves them out
    and says why."""
    root = shutil.copytree(request.getfixturevalue(stored), tmp_path / "store",
                           ignore=shutil.ignore_patterns("index.duckdb*", "logs"))
    with StoreServer(root) as server:
        run_dir = train(make_config(toy_world, tmp_path / "run", server.url, steps=2))
        refused_dir = train(make_config(toy_world, tmp_path / "mu-only", server.url, steps=1,
                                        **{"graft.require_behaviour_logprobs": True}))
    metrics = read_metrics(run_dir)
    for m in metrics:
        assert m["frac_grafted"] > 0 and m["peer_rollouts_consumed"] > 0
        assert m["peer_rollouts_without_mu"] == m["peer_rollouts_consumed"] == m["projection_none"]
        assert m["peer_rollouts_mu_set_aside"] == (m["projection_none"] if stored == "raw_logprobs_store_root" else 0)
        # NaN (written as null): no row had a log rho or a b
        assert m["compat_weight_mean"] == 1.0 and m["log_rho_p50"] is None and m["behaviour_ratio_p50"] is None
        assert 0 <= m["clip_frac_grafted_without_mu"] <= 1 and m["clip_frac_grafted_without_mu"] == pytest.approx(
            m["clip_frac_grafted"])  # every grafted token is one without mu
    before, after = weights(toy_world.learner_dir), weights(run_dir / "checkpoints" / "step_000002")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    refused = read_metrics(refused_dir)[0]
    all_fail = round(refused["frac_all_fail"] * 8)
    assert all_fail > 0 and refused["frac_grafted"] == 0 and refused["groups_no_peer_only_without_mu"] == all_fail
