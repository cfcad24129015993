"""Data parallelism (trainer/distributed.py, the sharded checkpoints of trainer/checkpoint.py): 2 real
ranks under torchrun on the CPU (gloo), ddp and fsdp, against one process on the same global batch.

dist_worker.py runs the ranks (a subprocess timeout guards against hangs); the reference runs the
same dist_step.update in this process with no process group."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_step import global_groups, make_optimizer, tiny_policy, update
from torchrun import REPO_ROOT, torchrun

from graft.rollouts.files import list_checkpoints
from graft.trainer.checkpoint import (
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    restore_rng_state,
    resumable,
    rng_state,
)
from graft.trainer.config import ParallelConfig, TrainConfig
from graft.trainer.distributed import (
    DistContext,
    MiniBatchPlan,
    RowPlaces,
    close_distributed,
    decoder_layers,
    fsdp_mixed_precision,
    init_distributed,
    mini_batch_rows,
    plan_mini_batches,
    reduce_metrics,
    row_places,
    split_for_rank,
)
from graft.trainer.loss import LossConfig

WORKER = Path(__file__).parent / "helpers" / "dist_worker.py"
ONE_PROCESS = DistContext("none", torch.device("cpu"))
ATOL = 1e-5


def run_ranks(strategy: str, out_dir: Path, timeout_s: float = 600.0) -> list[dict]:
    """torchrun 2 ranks of dist_worker.py (tests/trainer/helpers/torchrun.py: a hang fails the test)."""
    torchrun([str(WORKER), strategy, str(out_dir)], timeout_s=timeout_s)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def ranks(request, tmp_path_factory):
    return request.param, run_ranks(request.param, tmp_path_factory.mktemp(request.param))


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str, atol: float = ATOL):
    assert set(actual) == set(expected), f"{what}: names differ"
    worst = max((float((actual[k] - expected[k]).abs().max()), k) for k in expected)
    assert worst[0] <= atol, f"{what}: {worst[1]} differs by {worst[0]:.2e}"


@pytest.fixture(scope="module")
def one_process():
    """dist_worker's equivalence and zero-rows scenarios in this process, on the whole global batch."""
    import dist_worker

    before = rng_state()
    try:
        reference = dist_worker.equivalence(ONE_PROCESS)
        wrapped, optimizer, scheduler, pi_old, tokenizer = dist_worker.fresh(ONE_PROCESS)
        groups = global_groups(tokenizer, pi_old)
        rank0_rows = [row for group in split_for_rank(groups, 0, 2) for row in group]  # what rank 0 holds
        result = update(wrapped, optimizer, scheduler, ONE_PROCESS, rank0_rows, LossConfig(), 0, tokenizer.pad_token_id)
        zero_rows = {"params": dist_worker.params(wrapped), "loss": result.loss_share}
    finally:
        restore_rng_state(before)
    return {"equivalence": reference, "zero_rows": zero_rows}


# ---- 2 ranks against one process -----------------------------------------------------------------

@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_two_ranks_take_the_update_of_one_process_on_the_global_batch(ranks, one_process, aggregation):
    strategy, results = ranks
    expected = one_process["equivalence"][aggregation]
    for rank, result in enumerate(results):
        got = result["equivalence"][aggregation]
        assert got["optimizer_steps"] == expected["optimizer_steps"] == [2, 2]
        assert_close(got["first_grads"], expected["first_grads"], f"{strategy} rank {rank} gradients of the first mini-batch")
        assert got["losses"] == pytest.approx(expected["losses"], abs=ATOL)
        for got_norms, expected_norms in zip(got["grad_norms"], expected["grad_norms"]):
            assert got_norms == pytest.approx(expected_norms, rel=ATOL)
        assert_close(got["params"], expected["params"], f"{strategy} rank {rank} parameters after 2 steps")
    assert results[0]["world_size"] == 2


def test_the_gradient_is_not_trivially_equal(one_process):
    """The aggregations really differ (a normaliser bug could not hide behind identical gradients)."""
    grads = {agg: r["first_grads"]["model.norm.weight"] for agg, r in one_process["equivalence"].items()}
    assert float((grads["token-mean"] - grads["seq-mean-token-mean"]).abs().max()) > 1e-4
    assert float((grads["token-mean"] - grads["seq-mean-token-sum-norm"]).abs().max()) > 1e-4


def test_a_rank_without_rows_finishes_the_step_with_the_other(ranks, one_process):
    strategy, results = ranks
    idle = results[1]["zero_rows"]
    assert idle["micro_batches_run"] == 0 and idle["padding_passes"] > 0 and idle["optimizer_steps"] == 2
    for rank, result in enumerate(results):
        assert_close(result["zero_rows"]["params"], one_process["zero_rows"]["params"], f"{strategy} rank {rank}")
        assert result["zero_rows"]["loss"] == pytest.approx(one_process["zero_rows"]["loss"], abs=ATOL)


def test_metrics_reduce_over_ranks(ranks):
    for result in ranks[1]:
        reduced = result["metrics"]["reduced"]
        assert reduced["rows"] == 3.0 and reduced["nan_on_rank_1"] == 2.0
        assert reduced["reward"] == pytest.approx((0.5 * 2 + 1.0 * 6) / 8)
        assert reduced["only_rank_1"] == 3.0 and math.isnan(reduced["nowhere"]) and reduced["step_time_s"] == 1.5
        assert result["metrics"]["mismatch_raised"]
        assert result["metrics"]["max_over_ranks"] == 4


def test_streamed_full_weights_equal_the_gathered_state_dict(ranks):
    strategy, results = ranks
    assert results[0]["full_weights"]["streamed_equals_gathered"]
    assert results[0]["full_weights"]["names"] == results[1]["full_weights"]["names"]
    assert "lm_head.weight" in results[0]["full_weights"]["names"]  # the names vLLM's loader maps


# ---- sharded checkpoints --------------------------------------------------------------------------

def test_resume_from_a_sharded_checkpoint_reproduces_the_next_step(ranks):
    strategy, results = ranks
    for rank, result in enumerate(results):
        saved = result["checkpoint"]
        assert_close(saved["loaded_params"], saved["saved_params"], f"{strategy} rank {rank} loaded", atol=0.0)
        assert_close(saved["resumed"], saved["continuous"], f"{strategy} rank {rank} resumed step", atol=1e-7)
        assert saved["restored"] == {"step": 1, "loop": saved["loop_state"], "world_size": 2}
    moved = max(float((results[0]["checkpoint"]["continuous"][k] - results[0]["checkpoint"]["saved_params"][k]).abs().max())
                for k in results[0]["checkpoint"]["saved_params"])
    assert moved > 1e-4  # the step after the checkpoint changed the weights


def test_a_two_rank_checkpoint_loads_and_continues_in_one_process(ranks):
    strategy, results = ranks
    saved = results[0]["checkpoint"]
    path = Path(saved["path"])
    assert is_sharded_checkpoint(path) and list_checkpoints(path.parent, resumable) == [path]
    before = rng_state()
    try:
        torch.manual_seed(777)
        model, tokenizer = tiny_policy()
        pi_old, _ = tiny_policy()
        optimizer, scheduler = make_optimizer(model)
        restored = load_sharded_checkpoint(path, model, optimizer, scheduler, ONE_PROCESS)
        assert restored["world_size"] == 2 and restored["loop"] == saved["loop_state"]
        assert_close(dict(model.state_dict()), saved["saved_params"], f"{strategy} checkpoint in one process", atol=0.0)
        groups = global_groups(tokenizer, pi_old.eval())  # rank 0's restored RNG draws the same batch
        update(model, optimizer, scheduler, ONE_PROCESS, [row for g in groups for row in g], LossConfig(), 1,
               tokenizer.pad_token_id)
        assert_close(dict(model.state_dict()), saved["continuous"], f"{strategy} next step in one process")
    finally:
        restore_rng_state(before)


def test_the_hf_export_loads_with_transformers_and_gives_the_sharded_logits(ranks):
    from dist_worker import PROBE
    from transformers import AutoModelForCausalLM

    strategy, results = ranks
    saved = results[0]["checkpoint"]
    model = AutoModelForCausalLM.from_pretrained(saved["path"], dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.architectures == ["LlamaForCausalLM"]
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits  # (1, 6, V)
    assert float((logits - saved["logits"]).abs().max()) <= ATOL


# ---- in one process -------------------------------------------------------------------------------

def test_split_for_rank_is_contiguous_balanced_and_in_order():
    items = list(range(7))
    blocks = [split_for_rank(items, r, 3) for r in range(3)]
    assert blocks == [[0, 1, 2], [3, 4], [5, 6]]
    assert [split_for_rank(items[:1], r, 2) for r in range(2)] == [[0], []]


def test_mini_batches_of_the_ranks_together_are_one_process_mini_batches():
    total, num_mini = 11, 3
    one = mini_batch_rows(RowPlaces(list(range(total)), total), num_mini, torch.Generator().manual_seed(4))
    order = torch.randperm(total, generator=torch.Generator().manual_seed(4)).tolist()
    assert one == [order[m::num_mini] for m in range(num_mini)]  # what _update_policy draws today
    ranks = [RowPlaces(list(range(6)), total), RowPlaces(list(range(6, 11)), total)]
    per_rank = [mini_batch_rows(places, num_mini, torch.Generator().manual_seed(4)) for places in ranks]
    for m in range(num_mini):
        together = per_rank[0][m] + [i + 6 for i in per_rank[1][m]]
        assert sorted(together) == sorted(one[m])
    # rows that are not one contiguous run of the job's (a rank's DAPO refill rows after its first round's)
    places = RowPlaces([0, 1, 2, 7, 8, 9], total)
    picked = mini_batch_rows(places, num_mini, torch.Generator().manual_seed(4))
    assert [[places.index[i] for i in mini] for mini in picked] == [[r for r in o if r in places.index] for o in one]


def test_row_places_rebuild_one_process_order_from_prompt_positions():
    """A prompt's rows together, prompts in the order of their positions, whatever order the rows came in."""
    places = row_places(ONE_PROCESS, [4, 4, 0, 0, 0, 9])
    assert places == RowPlaces([3, 4, 0, 1, 2, 5], 6)
    assert row_places(ONE_PROCESS, [0, 0, 1, 1]) == RowPlaces([0, 1, 2, 3], 4)


def test_plan_and_loss_scale():
    plans = plan_mini_batches(ONE_PROCESS, [12.0, 0.0], [2, 0])
    assert plans == [MiniBatchPlan(12.0, 2, 1), MiniBatchPlan(0.0, 0, 1)]
    assert MiniBatchPlan(12.0, 2, world_size=2).loss_scale(3.0) == 0.5  # 3/12 of the loss, times the 2 DDP divides by
    with pytest.raises(ValueError, match="denominators"):
        plan_mini_batches(ONE_PROCESS, [1.0], [])


def test_reduce_metrics_in_one_process_is_nan_aware():
    out = reduce_metrics(ONE_PROCESS, sums={"n": 3.0, "gone": float("nan")}, means={"m": (2.0, 4.0), "empty": (1.0, 0.0)},
                         maxima={"t": float("nan")})
    assert out["n"] == 3.0 and out["m"] == 2.0
    assert math.isnan(out["gone"]) and math.isnan(out["empty"]) and math.isnan(out["t"])


def test_fsdp_units_and_mixed_precision():
    model, _ = tiny_policy()
    assert len(decoder_layers(model)) == 2
    with pytest.raises(ValueError, match="get_decoder"):
        decoder_layers(torch.nn.Linear(2, 2))
    on_gpu = fsdp_mixed_precision(torch.device("cuda", 0), torch.bfloat16)
    assert (on_gpu.param_dtype, on_gpu.reduce_dtype) == (torch.bfloat16, torch.float32)
    on_cpu = fsdp_mixed_precision(torch.device("cpu"), torch.bfloat16)
    assert (on_cpu.param_dtype, on_cpu.reduce_dtype) == (torch.float32, torch.float32)


def test_init_without_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    ctx = init_distributed(ParallelConfig(), "cpu")
    assert ctx == DistContext("none", torch.device("cpu")) and not ctx.distributed
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="parallel.strategy is 'none'"):
        init_distributed(ParallelConfig(), "cpu")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="torchrun"):
        init_distributed(ParallelConfig(strategy="ddp"), "cpu")


def test_fsdp_without_torchrun_is_one_rank_of_its_own_and_matches_one_process(monkeypatch):
    """The same code path on one rank: a process group of one (gloo), fully_shard, and the update of strategy none."""
    import dist_worker

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    ctx = init_distributed(ParallelConfig(strategy="fsdp"), "cpu")
    before = rng_state()
    try:
        assert (ctx.rank, ctx.world_size, ctx.distributed, ctx.owns_group) == (0, 1, True, True)
        updated = {}
        for name, context in (("fsdp", ctx), ("none", ONE_PROCESS)):
            wrapped, optimizer, scheduler, pi_old, tokenizer = dist_worker.fresh(context)
            groups = global_groups(tokenizer, pi_old)
            result = update(wrapped, optimizer, scheduler, context, [r for g in groups for r in g], LossConfig(), 0,
                            tokenizer.pad_token_id)
            assert result.optimizer_steps == 2
            updated[name] = dist_worker.params(wrapped)
            if name == "fsdp":
                assert type(wrapped).__name__ == "FSDPLlamaForCausalLM"
        assert_close(updated["fsdp"], updated["none"], "fsdp on one rank")
    finally:
        restore_rng_state(before)
        close_distributed(ctx)


def test_parallel_config_is_validated():
    base = {"model": {"path": "m"}, "data": {"dataset": "d"}, "method": "grpo"}
    assert TrainConfig(**base).parallel.strategy == "none"
    assert TrainConfig(**base, parallel={"strategy": "fsdp"}).parallel.strategy == "fsdp"
    with pytest.raises(ValueError, match="strategy"):
        TrainConfig(**base, parallel={"strategy": "zero3"})
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        TrainConfig(**{**base, "model": {"path": "m", "device": "cuda:1"}}, parallel={"strategy": "ddp"})


def test_the_cli_runs_as_a_module_and_refuses_ranks_without_a_strategy(tmp_path, monkeypatch):
    """torchrun starts `python -m graft.trainer.cli`; ranks launched with parallel.strategy none would each train a model
    of its own on the same data: refused, saying what to set. A strategy and rollout.seed_per_sample false are refused
    by the config (N ranks would not draw what one process draws)."""
    from typer.testing import CliRunner

    from graft.trainer.cli import app

    proc = subprocess.run([sys.executable, "-m", "graft.trainer.cli", "show-config"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == 0 and "parallel.strategy" in proc.stdout
    config = tmp_path / "c.yaml"
    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text('{"problem": "1+1=", "answer": "2"}\n')  # a dry run reads the data
    config.write_text(f"model: {{path: {tmp_path / 'm'}}}\ndata: {{dataset: {tmp_path / 'd.jsonl'}}}\nmethod: grpo\nrun_dir: {tmp_path / 'run'}\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    refused = CliRunner().invoke(app, ["train", "--config", str(config)])
    assert refused.exit_code != 0 and "WORLD_SIZE=2" in refused.output and "parallel.strategy=fsdp" in refused.output
    refused = CliRunner().invoke(app, ["train", "--config", str(config), "--set", "parallel.strategy=ddp",
                                       "--set", "rollout.seed_per_sample=false", "--dry-run"])
    assert refused.exit_code != 0 and "seed_per_sample" in refused.output
    accepted = CliRunner().invoke(app, ["train", "--config", str(config), "--set", "parallel.strategy=fsdp", "--dry-run"])
    assert accepted.exit_code == 0 and "strategy: fsdp" in accepted.output
