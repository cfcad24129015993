"""GRAFT inside TRL (integrations/trl) on the toy world: TRL's real training loop, a real store server on loopback.

The peer (byte-level BPE Qwen3) stored groups of 8 for every problem; on its family it is right often. A fresh,
untrained learner (character-level Llama) fails every group: plain GRPO has no signal there, GRAFT has the peer's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="the trl extra is not installed: pip install '.[trl]'")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from torchrun import torchrun  # noqa: E402
from trl_run import accuracy, dataset, make_args, make_trainer  # noqa: E402

from graft.integrations.trl import GraftGRPOTrainer  # noqa: E402
from graft.schemas import Problem  # noqa: E402
from graft.services.store_api.http.client import StoreClient  # noqa: E402
from graft.services.store_api.http.testing import StoreServer  # noqa: E402
from graft.trainer.batch import build_rows  # noqa: E402
from graft.trainer.data import load_peer_tokenizers  # noqa: E402
from graft.trainer.learner import load_learner  # noqa: E402
from graft.trainer.loss import LossBatch, LossConfig, graft_loss  # noqa: E402
from toy.models import build_tiny_model, save_model  # noqa: E402
from toy.world import learner_tokenizer  # noqa: E402


pytestmark = pytest.mark.slow
DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens


@pytest.fixture(scope="module")
def store(toy_world, tmp_path_factory):
    """A store server over a copy of the toy world's shards (other modules serve the original)."""
    root = shutil.copytree(toy_world.store_root, tmp_path_factory.mktemp("trl") / "store",
                           ignore=shutil.ignore_patterns("index.duckdb*", "logs"))
    with StoreServer(root) as server:
        yield server


@pytest.fixture(scope="module")
def fresh_learner(tmp_path_factory) -> Path:
    """An untrained character-level Llama: it never writes \\boxed{answer}, so every group fails."""
    tokenizer = learner_tokenizer()
    return save_model(build_tiny_model(tokenizer, "llama", hidden=64, seed=5), tokenizer,
                      tmp_path_factory.mktemp("trl") / "fresh_learner")


def weights(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def graft_lines(trainer) -> list[dict]:
    return [line for line in trainer.state.log_history if "graft/frac_grafted" in line]


def first_batch(trainer, problems: list[Problem]) -> list[dict]:
    """The first generation batch as TRL's RepeatSampler lays it out: each prompt's row G times in a row."""
    rows = dataset(problems[: trainer.args.generation_batch_size // trainer.num_generations])
    return [dict(row) for row in rows for _ in range(trainer.num_generations)]


def test_graft_trains_where_grpo_stays_put(toy_world, store, fresh_learner, tmp_path):
    graft = make_trainer(fresh_learner, toy_world.peer_problems, make_args(tmp_path / "graft", store.url, toy_world.peer_dir))
    start = weights(graft.model)
    graft.train()
    lines = graft_lines(graft)
    assert len(lines) == 2
    for line in lines:
        assert line["reward"] == 0 and line["graft/frac_all_fail"] == 1  # the learner fails every group
        assert line["graft/peer_hit_rate"] == 1 and line["graft/frac_grafted"] == 0.5  # capped at max_grafted_fraction
        assert line["graft/groups_capped"] == 2 and line["graft/store_lookup_failures"] == 0
        assert line["graft/peer_rollouts_consumed"] > 0 and line["graft/projection_spans"] > 0
        assert 0 < line["graft/compat_weight_mean"] <= 1 and 0 < line["graft/behaviour_ratio_p50"] <= 2.0
    # a grafted group whose rows that survive re-tokenisation share one reward carries no signal (its advantages are
    # recomputed over them: graft/grafted_groups_short counts such groups); the first step's groups still do
    assert lines[0]["grad_norm"] > 0 and all(line["graft/grafted_groups_short"] >= 0 for line in lines)
    moved = weights(graft.model)
    assert any(not torch.equal(start[k], moved[k]) for k in start)

    grpo = make_trainer(fresh_learner, toy_world.peer_problems, make_args(tmp_path / "grpo", None, None))
    grpo.train()
    assert all(line["grad_norm"] == 0 for line in grpo.state.log_history if "grad_norm" in line)
    assert all(torch.equal(start[k], v) for k, v in weights(grpo.model).items())  # no signal, no move


def test_a_store_that_is_down_leaves_trl_training_as_plain_grpo(toy_world, tmp_path):
    """The warm learner solves some of its family: GRPO moves it. With the store down, GRAFT's run is TRL's, bit for bit."""
    problems = toy_world.learner_problems[:2] + toy_world.peer_problems[:2]
    graft = make_trainer(toy_world.learner_dir, problems, make_args(tmp_path / "graft", DEAD_URL, toy_world.peer_dir,
                                                                    graft_store_options={"timeout_s": 2.0, "retries": 0}))
    graft.train()
    lines = graft_lines(graft)
    assert all(line["graft/frac_grafted"] == 0 for line in lines)
    assert sum(line["graft/store_lookup_failures"] + line["graft/store_lookups_skipped_backoff"] for line in lines) >= 1
    assert all(line["graft/frac_all_fail"] < 1 for line in lines)
    # the gate's tally is graft-train's (graft.trainer.peers.gate_tally): every all-fail group without a peer group counted
    # by why, here the lookups that failed
    assert all(line["graft/groups_no_peer"] == line["graft/groups_no_peer_unanswered"]
               == round(line["graft/frac_all_fail"] * 4) for line in lines)  # 4 groups a batch

    model = AutoModelForCausalLM.from_pretrained(toy_world.learner_dir)
    plain = GRPOTrainer(model=model, reward_funcs=accuracy, train_dataset=dataset(problems),
                        processing_class=graft.processing_class,
                        args=make_args(tmp_path / "plain", None, None))  # a GRPOConfig with the graft fields unset
    start = weights(model)
    plain.train()
    after = weights(plain.model)
    assert any(not torch.equal(start[k], after[k]) for k in start)  # GRPO had signal
    assert all(torch.equal(after[k], v) for k, v in weights(graft.model).items())
    assert [line["loss"] for line in plain.state.log_history if "loss" in line] == \
           [line["loss"] for line in graft.state.log_history if "loss" in line]


def test_the_loss_of_a_spliced_batch_is_graft_trains_loss(toy_world, store, tmp_path):
    """TRL's dapo loss on a batch with grafted rows equals trainer/loss.py's token-mean graft_loss on the same rows
    (advantages, c = w * b, clipping on both sides and the dual clip) within 1e-6."""
    problems = toy_world.learner_problems[:2] + toy_world.peer_problems[:2]  # mixed groups and grafted ones
    args = make_args(tmp_path / "loss", store.url, toy_world.peer_dir, epsilon=0.2, epsilon_high=0.28, delta=3.0,
                     graft_options={"max_grafted_fraction": 1.0})
    trainer = make_trainer(toy_world.learner_dir, problems, args)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which this test stands in for
    batch = trainer._generate_and_score_completions(first_batch(trainer, problems))
    grafted = batch["graft_is_grafted"]
    assert grafted.any() and (~grafted & (batch["graft_sequence_advantages"] != 0)).any()
    assert batch["advantages"].shape == batch["completion_ids"].shape

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logprobs, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, batch["completion_ids"].shape[1])
    # a pi_old away from the current policy, so that the ratio clips low and high and the dual clip binds
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0))
    batch["old_per_token_logps"] = logprobs + 1.5 * noise
    trl_loss = trainer.compute_loss(trainer.model, batch)

    loss_cfg = LossConfig.from_train(args.train_config(str(toy_world.learner_dir)))
    assert loss_cfg.ppo.loss_agg == "token-mean" and loss_cfg.ppo.dual_clip_c == 3.0
    ours, metrics = graft_loss(LossBatch(
        logprobs=logprobs, old_logprobs=batch["old_per_token_logps"], advantages=batch["graft_sequence_advantages"],
        mask=batch["completion_mask"].bool(), token_weight=batch["graft_token_weights"], is_grafted=grafted,
    ), loss_cfg)
    assert metrics["clip_frac_onpolicy"] > 0 and metrics["clip_frac_grafted"] > 0
    assert metrics["tokens_grafted"] > 0 and metrics["token_weight_mean_grafted"] < 1
    assert abs(float(trl_loss.detach()) - float(ours)) <= 1e-6, (float(trl_loss.detach()), float(ours))
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())


def test_a_peer_with_another_tokenizer_is_retokenised_as_graft_train_does(toy_world, store, fresh_learner, tmp_path):
    """The grafted rows TRL trains on are graft-train's rows of the same peer groups: the same learner tokens, the
    same projected mu~, the same advantages."""
    args = make_args(tmp_path / "retok", store.url, toy_world.peer_dir)
    trainer = make_trainer(fresh_learner, toy_world.peer_problems, args)
    plans = []
    planned = trainer._plan
    trainer._plan = lambda lookup, rewards: plans.append(planned(lookup, rewards)) or plans[-1]  # a spy on the real plan
    trainer.model.train()
    batch = trainer._generate_and_score_completions(first_batch(trainer, toy_world.peer_problems))
    (plan,) = plans
    grafting = [d for d in plan.decisions if d.grafts]
    assert grafting and all(d.peer_group.rollouts[0].tokenizer_id != trainer.graft.learner.tokenizer_id for d in grafting)

    cfg = args.train_config(str(fresh_learner), dataset=str(toy_world.problems_path))
    problem_of = {p.prompt_id: p for p in toy_world.peer_problems}
    # graft-train's rows of these groups (build_rows reads a grafted group's own rollouts only under union)
    expected = build_rows(cfg, load_learner(cfg, None), grafting, [d.peer_group for d in grafting], problem_of,
                          load_peer_tokenizers(cfg))
    spliced = [row for row in plan.slots.values() if row is not None]
    assert len(spliced) == len(expected.rows) > 0 and expected.counts.projections["spans"] == len(expected.rows)
    for ours, theirs in zip(spliced, expected.rows):
        assert ours.completion_ids == theirs.completion_ids
        assert ours.behaviour_logprobs == theirs.behaviour_logprobs  # mu~, exactly
        assert ours.advantage == theirs.advantage and ours.num_content_tokens == theirs.num_content_tokens
    for k, row in plan.slots.items():  # and those rows are what the batch holds (one process: global row = local row)
        n = len(row.completion_ids) if row is not None else 0
        assert batch["completion_mask"][k].sum() == n
        if row is not None:
            assert batch["completion_ids"][k, :n].tolist() == row.completion_ids
            assert batch["graft_token_weights"][k, :n].tolist() == row.token_weight.tolist()


def test_two_processes_take_the_same_decisions_and_update_as_one(toy_world, store, fresh_learner, tmp_path):
    """3 groups of 8 per step, 12 rows per process: the middle group is split over the two processes. Greedy
    sampling makes both runs draw the same completions (TRL seeds every process differently), and prompts of one
    length pad alike on one process and on two (TRL's logprobs of a left-padded row differ by ~1e-4 per token).
    SGD: Adam would turn the 1e-7 differences of summing the gradient in another order into +-lr on weights whose
    gradient is ~0."""
    problems = [p for p in toy_world.peer_problems if len(p.problem) == 6]
    assert len(problems) >= 6
    common = {"max_steps": 2, "optim": "sgd", "learning_rate": 1.0, "generation_kwargs": {"do_sample": False},
              "graft_options": {"max_grafted_fraction": 1.0, "token_is": "tis", "peer_negative_scale": 1.0}}
    results = {}
    for nproc, per_device in ((1, 24), (2, 12)):
        out = tmp_path / f"nproc{nproc}"
        out.mkdir()
        spec = {"out": str(out), "store_url": store.url, "peer_dir": str(toy_world.peer_dir),
                "learner_dir": str(fresh_learner), "problems": [p.model_dump() for p in problems],
                "args": common | {"per_device_train_batch_size": per_device}}
        (out / "spec.json").write_text(json.dumps(spec))
        torchrun([str(Path(__file__).parent / "helpers" / "trl_run.py"), str(out / "spec.json")], nproc=nproc, timeout_s=600)
        lines = [line for line in json.loads((out / "log_history.json").read_text()) if "graft/frac_grafted" in line]
        results[nproc] = (lines, torch.load(out / "weights.pt"))
    (one, one_weights), (two, two_weights) = results[1], results[2]
    assert len(one) == len(two) == 2
    for step, (a, b) in enumerate(zip(one, two)):
        assert a["graft/frac_grafted"] == b["graft/frac_grafted"] == 1.0
        for key in ("graft/peer_rollouts_consumed", "graft/dropped_round_trip", "graft/dropped_overlength",
                    "graft/projection_spans", "reward"):
            assert a[key] == b[key], key
        # float32 sums over 12 rows and over 24 differ by ~1e-6 relative; one update carries that into step 2
        tolerance = 2e-5 if step == 0 else 1e-3
        for key in ("loss", "grad_norm", "graft/compat_weight_mean", "graft/log_rho_p50", "graft/behaviour_ratio_p50"):
            assert b[key] == pytest.approx(a[key], rel=tolerance, abs=1e-7), (step, key)
    start = weights(AutoModelForCausalLM.from_pretrained(fresh_learner))
    moved = max(float((one_weights[k] - start[k]).abs().max()) for k in start)
    worst = max(float((one_weights[k] - two_weights[k]).abs().max()) for k in one_weights)
    assert moved > 5e-3 and worst <= 1e-4, (moved, worst)  # the update is ~100x the difference


class SampledLogprobsTrainer(GraftGRPOTrainer):
    """vLLM's stand-in on the CPU (vLLM needs a GPU): transformers samples, and the sampling logprobs come back as
    vLLM returns them, a little off the trainer's (a sampler's numerics), so that TRL's importance correction acts."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.use_vllm = False  # the parent's transformers path
        try:
            completion_ids, _ = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations)
        finally:
            self.use_vllm = True
        model = self.accelerator.unwrap_model(self.model)
        logprobs = []
        with torch.no_grad():
            for prompt, completion in zip(prompt_ids, completion_ids):
                ids = torch.tensor([list(prompt) + list(completion)])
                scores = (model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / self.temperature).log_softmax(-1)
                picked = scores.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
                logprobs.append((picked - 0.01).tolist())  # the sampler's numerics
        return completion_ids, logprobs


def test_under_vllm_grafted_rows_are_kept_out_of_trls_importance_correction(toy_world, store, fresh_learner, tmp_path):
    """TRL multiplies the loss by exp(pi_old - sampling logps), masked outside its bounds: a peer's logprobs there
    would mask grafted rows out. Grafted rows get ratio 1 and pi_old as their sampling logps; the learner's rows keep
    TRL's ratio."""
    args = make_args(tmp_path / "vllm", store.url, toy_world.peer_dir)
    trainer = SampledLogprobsTrainer(model=AutoModelForCausalLM.from_pretrained(fresh_learner), reward_funcs=accuracy,
                                     args=args, train_dataset=dataset(toy_world.peer_problems),
                                     processing_class=AutoTokenizer.from_pretrained(fresh_learner))
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.model.train()
    batch = trainer._generate_and_score_completions(first_batch(trainer, toy_world.peer_problems))
    grafted = batch["graft_is_grafted"]
    ratio = batch["importance_sampling_ratio"]  # (B, 1): sequence_mask, TRL's default
    assert grafted.any() and (~grafted).any()
    assert torch.equal(ratio[grafted], torch.ones_like(ratio[grafted]))
    mask = batch["completion_mask"].bool()
    learner_ratio = torch.exp(((batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * mask).sum(1))
    kept = (learner_ratio[~grafted] <= trainer.args.vllm_importance_sampling_clip_max).float()
    assert torch.allclose(ratio[~grafted].squeeze(1), learner_ratio[~grafted] * kept, rtol=1e-5)
    assert not torch.allclose(ratio[~grafted], torch.ones_like(ratio[~grafted]))  # TRL's correction acts there
    rows = grafted[:, None] & mask
    assert torch.equal(batch["sampling_per_token_logps"][rows], batch["old_per_token_logps"][rows])


def test_the_brokers_settings_act_in_trl(toy_world, store, fresh_learner, tmp_path):
    """want_misses and max_times_served in a TRL run: the all-fail prompts that got no peer group to graft become wants
    (with their problems: a generator can sample them), and each grafted group goes to the store's served ledger, whose
    cap then keeps it from being served again."""
    problems = toy_world.learner_problems[:2] + toy_world.peer_problems[:2]
    args = make_args(tmp_path / "trl", store.url, toy_world.peer_dir, graft_model_id="broker-learner",
                     graft_store_options={"want_misses": True, "max_times_served": 1},
                     graft_options={"max_grafted_fraction": 1.0, "token_is": "tis", "peer_negative_scale": 1.0})
    trainer = make_trainer(fresh_learner, problems, args)
    trainer.train()
    lines = graft_lines(trainer)
    with StoreClient(store.url) as client:
        wanted = {p.prompt_id: p for p in client.all_wanted() if "broker-learner" in p.learners}
        peer_groups = {row["group_id"] for page in client.iter_rollouts(model=toy_world.peer_model_id)
                       for row in page.to_pylist()}
        times = [client.times_served(group).get("broker-learner", 0) for group in peer_groups]
    assert sum(line["graft/store_broker_refused"] + line["graft/store_broker_failures"] for line in lines) == 0
    # every grafted group in the ledger, once: the cap served none of them again
    assert sum(times) == sum(line["graft/store_served_posted"] for line in lines) > 0 and max(times) == 1
    assert lines[1]["graft/groups_no_peer_served_out"] == round(lines[0]["graft/frac_grafted"] * len(problems)) > 0
    # the misses are wants, with their problems (a generator samples and scores them): the prompts whose peer groups
    # are uninformative at both steps, the served-out ones at the second (sent at the end: no line counts those)
    uninformative = lines[0]["graft/groups_peer_uninformative"]
    assert trainer.graft.peers.counters.wants_posted == 2 * uninformative + lines[1]["graft/groups_no_peer_served_out"]
    assert set(wanted) == {p.prompt_id for p in problems}
    problem_of = {p.prompt_id: p for p in problems}
    assert all((w.problem, w.answer) == (problem_of[w.prompt_id].problem, problem_of[w.prompt_id].answer)
               for w in wanted.values())


@pytest.mark.parametrize("settings, named", [
    ({"graft_options": {"union_all_success": True}}, "union_all_success"),
    ({"graft_options": {"token_is": "luffy"}}, "luffy"),
    ({"beta": 0.04}, "kl_on_peer"),
    ({"scale_rewards": "batch"}, "scale_rewards"),
    ({"graft_options": {"kapa": 1.0}}, "kapa"),  # graft-train's own validation: a typo fails
    ({"graft_options": {"is_cap": -1.0}}, "is_cap"),
    ({"graft_store_options": {"mode": "cotrain"}}, "peers.source"),  # how peers arrive is no store option
    ({"graft_store_options": {"replay_from": "runs/graft"}}, "peers.source"),  # was accepted and ignored
    ({"graft_peer_source": "replay"}, "graft-train replay"),  # the one source the adapter does not run
    ({"graft_peer_source": "cotrain", "graft_lookup_wait_s": 5.0}, "prefetch's wait"),  # would do nothing there
    ({"graft_peer_source": "cotrain", "graft_publish": False}, "a co-trainer publishes"),
    ({"graft_peer_source": "cotrain", "graft_peer_options": {"partner_timeout_s": 5}}, "partner_timeout_s"),
    ({"graft_peer_options": {"publish": True}}, "graft_publish"),  # one setting, one name
    ({"graft_publish": True, "graft_store_url": None}, "graft_store_url"),  # nowhere to publish to
    ({"graft_peer_source": "lockstep", "graft_store_options": {"want_misses": True}}, "lockstep"),  # graft-train's rule
    ({"graft_peer_tokenizers": ["tok-1=/a", "/b"]}, "ID=DIR"),
])
def test_graft_config_refuses_what_trl_cannot_do_as_graft_train_does(tmp_path, settings, named):
    with pytest.raises(ValueError, match=named):
        make_args(tmp_path, "http://127.0.0.1:8600", None, **settings)


def test_graft_config_is_graft_trains_configuration_of_the_same_run(tmp_path):
    args = make_args(tmp_path, "http://127.0.0.1:8600", None, epsilon_high=0.28, delta=3.0, loss_type="dr_grpo",
                     graft_peer_tokenizers=["tok-1=/models/peer"], graft_options={"kappa": 0.5},
                     graft_store_options={"timeout_s": 3.0})
    cfg = args.train_config("/models/learner")
    assert cfg.method == "graft" and cfg.store.url == "http://127.0.0.1:8600" and cfg.store.timeout_s == 3.0
    assert cfg.graft.kappa == 0.5 and cfg.graft.is_cap == 2.0 and cfg.graft.peer_tokenizers == {"tok-1": "/models/peer"}
    assert (cfg.ppo.eps_low, cfg.ppo.eps_high, cfg.ppo.dual_clip_c) == (0.2, 0.28, 3.0)
    assert cfg.ppo.loss_agg == "seq-mean-token-sum-norm" and cfg.rollout.max_response_tokens == 16
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step) == (8, 4)
    assert make_args(tmp_path, None, None).train_config("/models/learner").method == "grpo"


def test_graft_config_defaults_to_graft_trains_clip_and_takes_trls_when_asked(tmp_path):
    """Where the user sets no clip, the TRL run's loss is graft-train's (eps_high 0.28, dual clip 3), not TRL's
    (epsilon_high = epsilon, no dual clip): GRAFT and its GRPO arm then train as graft-train's do."""
    defaults = make_args(tmp_path, "http://127.0.0.1:8600", None).train_config("/models/learner").ppo
    from graft.trainer.config import PPOConfig

    assert (defaults.eps_low, defaults.eps_high, defaults.dual_clip_c) == (PPOConfig().eps_low, PPOConfig().eps_high,
                                                                          PPOConfig().dual_clip_c)
    trls = make_args(tmp_path, "http://127.0.0.1:8600", None, epsilon_high=None, delta=None).train_config("/m").ppo
    assert (trls.eps_high, trls.dual_clip_c) == (0.2, None)


def test_the_trl_adapter_runs_graft_trains_default_graft(tmp_path):
    """With no graft_options the TRL run grafts with graft-train's default GRAFT, field for field (verl's trainer: the
    same check in tests/integrations/inside_verl/test_config.py): a change of the default moves every trainer at once."""
    from graft.trainer.config import GraftOptions

    graft = make_args(tmp_path, "http://127.0.0.1:8600", None, graft_options=None).train_config("/models/learner").graft
    mine = {"peer_tokenizers"}  # the run's own (an empty list or map: none)
    assert graft.model_dump(exclude=mine) == GraftOptions().model_dump(exclude=mine)


@pytest.mark.parametrize("stored", ["text_only_store_root", "raw_logprobs_store_root"])
def test_peer_groups_without_mu_graft_in_trl_with_w_one_and_are_counted(stored, toy_world, fresh_learner, request,
                                                                          tmp_path):
    """The toy peer's groups stored without behaviour logprobs (logprobs_mode 'none'), or with logprobs that are not
    their mu ('raw' at T = 0.7: schemas.mu_is_behaviour): TRL grafts them with b = 1 and w = 1 (docs/algorithm.md section 11)
    and counts them in graft/peer_rollouts_without_mu (the second kind also in graft/peer_rollouts_mu_set_aside)."""
    root = shutil.copytree(request.getfixturevalue(stored), tmp_path / "store",
                           ignore=shutil.ignore_patterns("index.duckdb*", "logs"))
    with StoreServer(root) as server:
        trainer = make_trainer(fresh_learner, toy_world.peer_problems,
                               make_args(tmp_path / "graft", server.url, toy_world.peer_dir))
        start = weights(trainer.model)
        trainer.train()
    lines = graft_lines(trainer)
    assert len(lines) == 2
    for line in lines:
        assert line["graft/frac_grafted"] > 0 and line["graft/peer_rollouts_consumed"] > 0
        assert line["graft/peer_rollouts_without_mu"] == line["graft/peer_rollouts_consumed"]
        assert line["graft/projection_none"] > 0 and line["graft/projection_spans"] == 0
        assert line["graft/peer_rollouts_mu_set_aside"] == (
            line["graft/projection_none"] if stored == "raw_logprobs_store_root" else 0)
        assert line["graft/compat_weight_mean"] == 1.0
    assert any(not torch.equal(start[k], v) for k, v in weights(trainer.model).items())
