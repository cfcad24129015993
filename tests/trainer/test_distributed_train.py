"""graft-train data parallel through the real training loop: 2 ranks under torchrun (CPU, gloo), launched as a user
launches them (`torchrun --nproc-per-node 2 -m graft.trainer.cli train --config CONFIG`), against one process on the same global
batch, with the toy world's learner and a real store server on loopback holding the peer's groups.

The one-process reference samples with rollout.seed_per_sample (each rollout seeded by its place in the step's
batch, what data-parallel ranks do), so that both draw the same rollouts. Every torchrun job runs under a timeout
that kills it (tests/trainer/helpers/torchrun.py): a collective that hangs fails the test."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import orjson
import pytest
import torch
import yaml
from dist_train_worker import non_finite_grafts
from safetensors.torch import load_file
from torchrun import torchrun
from train_configs import make_config

import graft.trainer.batch
from graft.schemas import Problem
from graft.services.store_api.http.testing import StoreServer
from graft.trainer.config import TrainConfig
from graft.trainer.loop import train
from toy.task import write_problems_jsonl

pytestmark = pytest.mark.slow
ATOL = 1e-5  # fp32: the ranks' micro-batches sum in another order than one process's
# Weights after Adam steps: AdamW divides by sqrt(v), so a parameter whose gradient is near zero turns the ranks'
# other summation order into an update of up to lr. Measured: 3.25e-5 on one v_proj entry after 3 steps at lr 2e-3
# on an AMD EPYC host (an Intel host stayed under 1e-5); a real mismatch (a row trained twice or missed, another
# bias correction) moves weights by 5e-4 and more (test_a_checkpoint_before_the_first_update_...: 5.15e-4).
WEIGHT_ATOL = 1e-4
DEAD_STORE = "http://127.0.0.1:9"  # discard port: nothing listens
WORKER = Path(__file__).parent / "helpers" / "dist_train_worker.py"
TIMES = {"step_time_s", "step_cpu_s", "generation_s", "gate_s", "update_s", "store_wait_s", "peer_group_age_s"}
# What two ranks count differently from one process by design: each rank asks the store for its own prompts.
PER_RANK = {"world_size", "store_lookups", "store_lookups_skipped_backoff", "store_lookups_late"}


@pytest.fixture(scope="module")
def store(toy_world):
    with StoreServer(toy_world.store_root) as server:
        yield server


def config(world, run_dir: Path, store_url: str | None, **overrides) -> TrainConfig:
    """The end-to-end tests' run (8 prompts x 4 rollouts), in 2 mini-batches of 2 micro-batches, sampling with seeds
    per rollout, a checkpoint every 2 steps."""
    return make_config(world, run_dir, store_url, **{
        "rollout.seed_per_sample": True, "optim.mini_batch_prompts": 4, "optim.micro_batch_size": 8,
        "checkpoint.every_steps": 2, **overrides})


def two_ranks(cfg: TrainConfig, strategy: str, *extra: str) -> Path:
    """`torchrun --nproc-per-node 2 -m graft.trainer.cli train --config CONFIG --set parallel.strategy=STRATEGY`."""
    path = Path(cfg.run_dir).with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    torchrun(["-m", "graft.trainer.cli", "train", "--config", str(path), "--set", f"parallel.strategy={strategy}", *extra])
    return Path(cfg.run_dir)


def metrics(run_dir: Path) -> list[dict]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def rank_steps(run_dir: Path, rank: int) -> list[dict[str, int]]:
    """The rank's own step lines (graft.trainer.loop: 'step N: G groups, K grafted, R rows trained on')."""
    log = run_dir / ("train.log" if rank == 0 else f"train.rank{rank}.log")
    pattern = re.compile(r"step (\d+): (\d+) groups, (\d+) grafted, (\d+) rows trained on")
    return [dict(zip(("step", "groups", "grafted", "rows"), map(int, m.groups()))) for m in pattern.finditer(log.read_text())]


def assert_same_line(got: dict, expected: dict, atol: float = ATOL) -> None:
    """A metrics line equal to one process's: counts exactly, floats within atol (relative above 1), NaN as NaN."""
    assert [k for k in got if k not in PER_RANK] == [k for k in expected if k not in PER_RANK]
    for key, value in expected.items():
        if key in TIMES or key in PER_RANK:
            continue
        other = got[key]
        if isinstance(value, float) and math.isnan(value):
            assert isinstance(other, float) and math.isnan(other), key
        elif isinstance(value, float):
            assert other == pytest.approx(value, abs=atol, rel=atol), (got["step"], key)
        else:
            assert other == value, (got["step"], key)


def assert_close_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str,
                         atol: float = WEIGHT_ATOL) -> None:
    assert set(got) == set(expected)
    worst = max((float((got[k] - expected[k]).abs().max()), k) for k in expected)
    assert worst[0] <= atol, f"{what}: {worst[1]} differs by {worst[0]:.2e}"


# ---- 2 ranks against one process: GRPO and GRAFT, ddp and fsdp -----------------------------------

EVAL_PROBLEMS = 129  # 65 + 64 on 2 ranks: 2 generate calls of 64 prompts on rank 0, 1 on rank 1


@pytest.fixture(scope="module")
def evaluated(toy_world, tmp_path_factory):
    """Overrides that evaluate at the end (step 3): 2 samples per problem (seeded per problem) on EVAL_PROBLEMS
    additions of two 2-digit numbers (the toy world's learner family)."""
    path = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    sums = [(10 + i % 90, 10 + i // 90) for i in range(EVAL_PROBLEMS)]  # distinct pairs
    path.write_bytes(b"".join(orjson.dumps({"problem": f"{a}+{b}=", "answer": str(a + b)}) + b"\n" for a, b in sums))
    return {"eval.every_steps": 3, "eval.benchmarks": {"toy": str(path)}, "eval.k": 2}


@pytest.fixture(scope="module")
def one_process(toy_world, store, evaluated, tmp_path_factory):
    """The one-process runs (3 steps each, evaluated at the end): GRPO and GRAFT."""
    root = tmp_path_factory.mktemp("one")
    return {method: train(config(toy_world, root / method, store.url, method=method, **evaluated))
            for method in ("grpo", "graft")}


@pytest.fixture(scope="module")
def ranked(toy_world, store, evaluated, tmp_path_factory):
    """2-rank runs (evaluated at the end), made on first use: (method, strategy) -> run directory."""
    root = tmp_path_factory.mktemp("ranks")
    runs: dict[tuple[str, str], Path] = {}

    def run(method: str, strategy: str) -> Path:
        if (method, strategy) not in runs:
            cfg = config(toy_world, root / f"{method}-{strategy}", store.url, method=method, **evaluated)
            runs[method, strategy] = two_ranks(cfg, strategy)
        return runs[method, strategy]

    return run


def evaluations(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in orjson.loads(line).items() if k != "wall_s"}
            for line in (run_dir / "eval.jsonl").read_bytes().splitlines()]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("method", ["grpo", "graft"])
def test_two_ranks_train_as_one_process_on_the_same_global_batch(toy_world, one_process, ranked, method, strategy):
    run_dir = ranked(method, strategy)
    expected, got = metrics(one_process[method]), metrics(run_dir)
    assert [m["step"] for m in got] == [1, 2, 3] and all(m["world_size"] == 2 for m in got)
    for line, reference in zip(got, expected):
        assert_same_line(line, reference)
        assert line["optimizer_updates"] == 2 and line["rollouts_generated"] == 8 * 4
    final = weights(run_dir / "checkpoints" / "step_000003")  # the HF export: the full weights, gathered once
    assert_close_weights(final, weights(one_process[method] / "checkpoints" / "step_000003"), f"{method} {strategy}")
    start = weights(toy_world.learner_dir)
    assert max(float((final[k] - start[k]).abs().max()) for k in start) > 1e-3  # the runs trained
    per_rank = [rank_steps(run_dir, rank) for rank in (0, 1)]
    assert [[s["groups"] for s in steps] for steps in per_rank] == [[4, 4, 4], [4, 4, 4]]  # 8 prompts, 4 per rank
    # the evaluation: each rank scored its block (under fsdp with the weights gathered once, rank 0 making 2
    # generate calls and rank 1 one), and together they found what one process finds
    (evaluation,) = evaluations(run_dir)
    assert evaluation == evaluations(one_process[method])[0]
    assert evaluation["benchmarks"]["toy"]["samples"] == 2 * EVAL_PROBLEMS
    assert 0 < evaluation["benchmarks"]["toy"]["avg_at_k"] < 1
    for rank, share in ((0, 65), (1, 64)):
        log = (run_dir / ("train.log" if rank == 0 else f"train.rank{rank}.log")).read_text()
        assert f"this rank scored {share} of the {EVAL_PROBLEMS} problems" in log
    if method == "graft":
        assert all(m["frac_grafted"] > 0 for m in got)
        assert all(any(s["grafted"] for s in steps) for steps in per_rank)  # grafted groups landed on both ranks
        assert [sum(s["grafted"] for s in steps) for steps in zip(*per_rank)] == [round(m["frac_grafted"] * 8) for m in got]


# ---- a rank without rows, a rank whose store is down ---------------------------------------------

def test_a_rank_with_zero_rows_finishes_every_step_with_the_other(toy_world, store, tmp_path):
    """One prompt per step on 2 ranks: rank 1 samples nothing and has no row, and pads every collective (fsdp's
    all-gathers and reduce-scatters, the single pass's forward) while rank 0 trains; the update is one process's."""
    overrides = {"steps": 4, "rollout.prompts_per_step": 1, "optim.mini_batch_prompts": 1,
                 "graft.max_grafted_fraction": 1.0, "checkpoint.every_steps": 0}
    reference = metrics(train(config(toy_world, tmp_path / "one", store.url, **overrides)))
    run_dir = two_ranks(config(toy_world, tmp_path / "ranks", store.url, **overrides), "fsdp")
    assert [s["rows"] for s in rank_steps(run_dir, 1)] == [0, 0, 0, 0]
    assert all(s["rows"] > 0 for s in rank_steps(run_dir, 0))
    got = metrics(run_dir)
    assert any(m["loss"] != 0 and m["frac_grafted"] == 1 for m in got)  # steps that trained (a grafted group)
    for line, expected in zip(got, reference, strict=True):
        assert_same_line(line, expected)
    assert_close_weights(weights(run_dir / "checkpoints" / "step_000004"), weights(tmp_path / "one" / "checkpoints" / "step_000004"),
                         "one prompt per step")


def test_a_rank_whose_store_is_down_trains_as_grpo_and_keeps_step_with_the_other(toy_world, store, tmp_path):
    """Rank 1 cannot reach its store (dist_train_worker.py gives it a dead URL): its lookups fail, its groups train as
    GRPO, and both ranks finish every step together; rank 0 grafts."""
    cfg = config(toy_world, tmp_path / "run", store.url, steps=2, **{"checkpoint.every_steps": 0})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    torchrun([str(WORKER), str(path), "fsdp", f"1={DEAD_STORE}"])
    rank0, rank1 = rank_steps(cfg.run_dir, 0), rank_steps(cfg.run_dir, 1)
    assert [s["step"] for s in rank0] == [s["step"] for s in rank1] == [1, 2]
    assert any(s["grafted"] for s in rank0) and not any(s["grafted"] for s in rank1)
    assert "peer lookup failed" in (cfg.run_dir / "train.rank1.log").read_text()
    for m in metrics(cfg.run_dir):
        assert m["frac_grafted"] > 0 and m["peer_lookup_ok"] == 0.5  # one of the two ranks' lookups answered
        assert m["store_lookup_failures"] + m["store_lookups_skipped_backoff"] + m["store_lookups_late"] >= 1
        assert math.isfinite(m["loss"]) and m["optimizer_updates"] == 2


# ---- checkpoints --------------------------------------------------------------------------------

def resumable_copy(run_dir: Path, destination: Path, step: int) -> Path:
    """The run as it was after checkpoint `step` (later checkpoints removed; resume truncates the metrics)."""
    shutil.copytree(run_dir, destination)
    for checkpoint in (destination / "checkpoints").iterdir():
        if int(checkpoint.name.removeprefix("step_")) > step:
            shutil.rmtree(checkpoint)
    return destination


def test_resume_from_a_sharded_checkpoint_reproduces_the_next_step(toy_world, store, ranked, tmp_path):
    full = ranked("graft", "fsdp")
    assert (full / "checkpoints" / "step_000002" / "dcp" / ".metadata").exists()
    copy = resumable_copy(full, tmp_path / "resumed", 2)
    two_ranks(config(toy_world, copy, store.url), "fsdp", "--resume")
    resumed, expected = metrics(copy), metrics(full)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert_same_line(resumed[2], expected[2], atol=0.0)
    a, b = weights(copy / "checkpoints" / "step_000003"), weights(full / "checkpoints" / "step_000003")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_two_rank_checkpoint_continues_in_one_process(toy_world, store, ranked, one_process, tmp_path):
    """2 fsdp ranks' step-2 checkpoint, resumed by one plain process: its step 3 is the ranks' step 3."""
    full = ranked("graft", "fsdp")
    copy = resumable_copy(full, tmp_path / "one", 2)
    train(config(toy_world, copy, store.url), resume=True)
    resumed = metrics(copy)
    assert [m["world_size"] for m in resumed] == [2, 2, 1]
    assert_same_line(resumed[2], metrics(full)[2])
    assert_close_weights(weights(copy / "checkpoints" / "step_000003"), weights(full / "checkpoints" / "step_000003"),
                         "2-rank checkpoint in one process")
    assert "written by 2 ranks and loads into 1" in (copy / "train.log").read_text()


def test_a_one_process_checkpoint_continues_on_two_fsdp_ranks(toy_world, store, one_process, tmp_path):
    """The other way: one process's step-2 checkpoint (HF files and trainer_state.pt) resumed by 2 fsdp ranks (its
    optimizer state sharded onto them): step 3 is one process's step 3."""
    copy = resumable_copy(one_process["graft"], tmp_path / "ranks", 2)
    two_ranks(config(toy_world, copy, store.url), "fsdp", "--resume")
    resumed, expected = metrics(copy), metrics(one_process["graft"])
    assert [m["world_size"] for m in resumed] == [1, 1, 2]
    assert_same_line(resumed[2], expected[2])
    assert_close_weights(weights(copy / "checkpoints" / "step_000003"),
                         weights(one_process["graft"] / "checkpoints" / "step_000003"), "one-process checkpoint on 2 ranks")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_hf_export_loads_with_transformers_and_gives_the_sharded_logits(ranked, strategy):
    """The checkpoint's HF files (the full weights gathered once by rank 0) against its sharded state (dcp/, every
    rank's shards), loaded into one process: the same logits."""
    from transformers import AutoModelForCausalLM

    from graft.trainer.checkpoint import load_sharded_checkpoint
    from graft.trainer.distributed import DistContext
    from graft.trainer.update import make_optimizer

    checkpoint = ranked("graft", strategy) / "checkpoints" / "step_000003"
    exported = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert exported.config.architectures == ["LlamaForCausalLM"]
    sharded = AutoModelForCausalLM.from_config(exported.config, dtype=torch.float32).eval()  # fresh weights
    cfg = TrainConfig.model_validate(yaml.safe_load((checkpoint.parents[1] / "config.yaml").read_text()))
    optimizer, scheduler = make_optimizer(cfg, sharded)
    load_sharded_checkpoint(checkpoint, sharded, optimizer, scheduler, DistContext("none", torch.device("cpu")))
    probe = torch.tensor([[5, 9, 12, 7, 3, 14, 2, 8]])  # (1, 8) token ids
    with torch.no_grad():
        a, b = exported(input_ids=probe).logits, sharded(input_ids=probe).logits  # (1, 8, V)
    assert float((a - b).abs().max()) <= ATOL
    assert float(a.abs().max()) > 0.1  # not a degenerate model


# ---- DAPO: refill rounds and several mini-batches -------------------------------------------------

@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dapo_refills_on_two_ranks_train_as_one_process(toy_world, store, tmp_path, strategy):
    """DAPO's refill rounds put each rank's rows of a step in round order (its block of round 1, then of round 2):
    laid end to end by rank they are not one process's order (round 1's prompts, then round 2's). The mini-batches
    are drawn over the step's prompts in one process's order, so with 2 mini-batches per step the ranks still take
    one process's updates."""
    overrides = {"method": "dapo", "steps": 3, "checkpoint.every_steps": 0}
    reference = metrics(train(config(toy_world, tmp_path / "one", None, **overrides)))
    run_dir = two_ranks(config(toy_world, tmp_path / "ranks", None, **overrides), strategy)
    assert any(m["dapo_rounds"] > 1 for m in reference)  # refills happened
    for line, expected in zip(metrics(run_dir), reference, strict=True):
        assert line["optimizer_updates"] == 2
        assert_same_line(line, expected)
    # one element of down_proj moves by ~1e-5 with any change of summation order (Adam's first steps divide a
    # near-zero gradient by its own size): one process with micro-batches of 3 rows instead of 8 moves it by 1.8e-5
    assert_close_weights(weights(run_dir / "checkpoints" / "step_000003"), weights(tmp_path / "one" / "checkpoints" / "step_000003"),
                         f"dapo {strategy}", atol=5e-5)


def test_fsdp_ranks_other_than_0_read_no_weights_and_the_kl_reference_is_sharded_alike(toy_world, store, tmp_path):
    """Under fsdp only rank 0 reads the policy's and the KL reference's weights; rank 1 builds both on the meta
    device and receives its shards (host memory for one full copy, not one per rank). Training, KL term included,
    is one process's."""
    overrides = {"method": "grpo", "steps": 2, "ppo.kl_beta": 0.1, "checkpoint.every_steps": 0}
    reference = metrics(train(config(toy_world, tmp_path / "one", store.url, **overrides)))
    run_dir = two_ranks(config(toy_world, tmp_path / "ranks", store.url, **overrides), "fsdp")
    got = metrics(run_dir)
    assert all(m["kl"] > 0 for m in got)
    for line, expected in zip(got, reference, strict=True):
        assert_same_line(line, expected)
    assert_close_weights(weights(run_dir / "checkpoints" / "step_000002"), weights(tmp_path / "one" / "checkpoints" / "step_000002"),
                         "fsdp with a KL reference")
    built = (run_dir / "train.rank1.log").read_text().count("built on the meta device, its shards received from rank 0")
    assert built == 2  # the policy and the reference
    assert "built on the meta device" not in (run_dir / "train.log").read_text()


# ---- an optimizer that never stepped, a rank whose grafted rows are all dropped --------------------

def test_a_checkpoint_before_the_first_update_leaves_adam_as_one_process_has_it(toy_world, tmp_path):
    """Step 1 has no signal (its prompts cannot be answered in 16 tokens; optim.skip_zero_advantage: no row to train
    on, no optimizer step), a checkpoint follows every step, and steps 2 and 3 train. Saving the optimizer that never
    stepped (and restoring it) must not give it Adam's state of one step: its first real update would take another
    bias correction than one process's. The 2 fsdp ranks, one process resumed from the ranks' step-1 checkpoint, and
    one fsdp rank resumed from one process's step-1 checkpoint all end where one process ends."""
    unanswerable = [Problem.from_text(f"{a}+987654321=", str(a + 987654321), "toy_add") for a in (123456789, 223456789)]
    dataset = write_problems_jsonl(unanswerable + toy_world.learner_problems[:4], tmp_path / "problems.jsonl")
    overrides = {"method": "grpo", "steps": 3, "data.dataset": str(dataset), "data.shuffle": False,
                 "rollout.prompts_per_step": 2, "optim.mini_batch_prompts": 2, "optim.skip_zero_advantage": True,
                 "checkpoint.every_steps": 1}
    one = train(config(toy_world, tmp_path / "one", None, **overrides))
    reference = metrics(one)
    assert [m["optimizer_updates"] for m in reference][0] == 0 and reference[0]["updates_skipped_no_signal"] == 1
    assert sum(m["optimizer_updates"] for m in reference[1:]) >= 1  # later steps trained
    expected = weights(one / "checkpoints" / "step_000003")

    ranks = two_ranks(config(toy_world, tmp_path / "ranks", None, **overrides), "fsdp")
    for line, reference_line in zip(metrics(ranks), reference, strict=True):
        assert_same_line(line, reference_line)
    assert_close_weights(weights(ranks / "checkpoints" / "step_000003"), expected, "2 fsdp ranks")

    resumed = resumable_copy(ranks, tmp_path / "resumed-one", 1)
    train(config(toy_world, resumed, None, **overrides), resume=True)
    assert_close_weights(weights(resumed / "checkpoints" / "step_000003"), expected, "the ranks' step 1 in one process")

    sharded = resumable_copy(one, tmp_path / "resumed-fsdp", 1)
    train(config(toy_world, sharded, None, **overrides, **{"parallel.strategy": "fsdp"}), resume=True)
    assert_close_weights(weights(sharded / "checkpoints" / "step_000003"), expected,
                         "one process's step 1 on 1 fsdp rank")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_whose_grafted_rows_are_all_dropped_backpropagates_its_first_pass(
    toy_world, store, tmp_path, monkeypatch, strategy,
):
    """One prompt per rank and step, in one mini-batch of one micro-batch (the update's forward is the first pass):
    rank 0's from the learner's family, rank 1's from the peer's, which the learner fails and grafts, the grafted rows
    coming out non-finite (dist_train_worker.non_finite_grafts). Rank 1 drops every row it grafted while
    rank 0 trains: it backpropagates its first pass with a zero gradient (one forward and one backward, as rank 0),
    and the update is one process's."""
    own, peer = toy_world.learner_problems[:3], toy_world.peer_problems[:3]
    dataset = write_problems_jsonl([p for pair in zip(own, peer) for p in pair], tmp_path / "problems.jsonl")
    overrides = {"data.dataset": str(dataset), "data.shuffle": False, "rollout.prompts_per_step": 2,
                 "optim.mini_batch_prompts": 2, "optim.micro_batch_size": 16, "graft.max_grafted_fraction": 1.0,
                 "checkpoint.every_steps": 0, "parallel.timeout_s": 120.0}  # a collective that hangs fails in 2 minutes
    poisoned = ",".join(p.prompt_id for p in peer)
    with monkeypatch.context() as patch:
        patch.setattr(graft.trainer.batch, "weigh_grafted_rows", non_finite_grafts(set(poisoned.split(","))))
        one = train(config(toy_world, tmp_path / "one", store.url, **overrides))
    cfg = config(toy_world, tmp_path / "ranks", store.url, **overrides)
    path = tmp_path / "ranks.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    torchrun([str(WORKER), str(path), strategy, "--non-finite-grafts", poisoned], timeout_s=240.0)
    got, reference = metrics(cfg.run_dir), metrics(one)
    # the case: a step where rank 1 grafted and dropped every row as non-finite (rank 0 grafts none of them) while
    # rank 0 trained
    steps = zip(rank_steps(cfg.run_dir, 0), rank_steps(cfg.run_dir, 1), got, strict=True)
    assert any(b["grafted"] and b["rows"] == 0 and a["rows"] > 0 and m["dropped_non_finite"] > 0
               and m["optimizer_updates"] == 1 for a, b, m in steps)
    for line, expected in zip(got, reference, strict=True):
        assert_same_line(line, expected)
    assert_close_weights(weights(cfg.run_dir / "checkpoints" / "step_000003"),
                         weights(one / "checkpoints" / "step_000003"), f"grafted rows dropped on rank 1, {strategy}")
