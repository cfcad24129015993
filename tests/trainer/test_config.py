"""The trainer's config: YAML + dotted overrides, validation messages, the shipped configs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from graft.schemas.overrides import apply_overrides, describe_fields, load_config
from graft.trainer.cli import app
from graft.trainer.config import GRAFT_PRESETS, LOOKUP_WAIT_S, StoreConfig, TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_follow_the_spec_but_b_and_peer_negatives():
    """The default GRAFT (docs/algorithm.md section 7): b = 1 and peer negatives x0: the confirmatory run's choice (docs/demo.md)."""
    cfg = TrainConfig(model={"path": "m"}, data={"dataset": "d"}, store={"url": "http://x"})
    assert (cfg.ppo.eps_low, cfg.ppo.eps_high, cfg.ppo.dual_clip_c) == (0.2, 0.28, 3.0)
    assert cfg.graft.is_cap == 2.0 and cfg.graft.kappa == 1.0 and cfg.graft.log_rho_min is None
    assert cfg.graft.token_is == "none" and cfg.graft.peer_negative_scale == 0.0 and cfg.graft.preset is None
    assert {name: getattr(cfg.graft, name) for name in GRAFT_PRESETS["b1_no_peer_neg"]} == GRAFT_PRESETS["b1_no_peer_neg"]
    assert not cfg.graft.union_all_success and not cfg.graft.group_normalized_weight and not cfg.graft.kl_on_peer
    assert cfg.graft.max_grafted_fraction == 0.5 and cfg.ppo.kl_beta == 0.0 and cfg.ppo.loss_agg == "token-mean"
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.optim.mini_batch_prompts) == (8, 128, 64)
    assert cfg.optim.lr == 1e-6 and cfg.rollout.max_response_tokens == 4096 and cfg.optim.ppo_epochs == 1
    assert cfg.peers.source == "prefetch" and cfg.peers.lookup_wait_s == LOOKUP_WAIT_S == 30 and not cfg.publishes
    assert not cfg.co_trains


@pytest.mark.parametrize("name", sorted(p.name for p in [*CONFIGS.glob("train*.yaml"), *CONFIGS.glob("compose_cpu_*.yaml")]
                                         if p.name != "compose_cpu_generator.yaml"))
def test_shipped_configs_validate(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no key of an earlier release (the demo's configs are demo/'s)
        cfg = load_config(TrainConfig, CONFIGS / name)
    assert cfg.method in ("grpo", "graft", "dapo")


def test_overrides_are_typed_and_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {dataset: d}\nmethod: grpo\n")
    cfg = load_config(TrainConfig, path, ["graft.peer_negative_scale=0", "graft.peer_models=[a, b]", "method=graft",
                             "store.url=http://h:1", "graft.log_rho_min=-2.5", "peers.source=cotrain"])
    assert cfg.graft.peer_negative_scale == 0.0 and cfg.graft.peer_models == ["a", "b"]
    assert cfg.method == "graft" and cfg.graft.log_rho_min == -2.5 and cfg.publishes and cfg.peers.wait_s == 30
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


def test_bad_input_gets_a_clear_error(tmp_path):
    with pytest.raises(ValidationError, match="needs store.url"):
        TrainConfig(model={"path": "m"}, data={"dataset": "d"}, method="graft")
    with pytest.raises(ValidationError, match="Extra inputs"):
        TrainConfig(model={"path": "m"}, data={"dataset": "d"}, method="grpo", graft={"peer_negative_scael": 0})
    with pytest.raises(ValidationError, match="mini_batch_prompts"):
        TrainConfig(model={"path": "m"}, data={"dataset": "d"}, method="grpo", optim={"mini_batch_prompts": 256})
    with pytest.raises(ValidationError, match="peer_models"):  # would accept no peer (the store refuses it too)
        TrainConfig(model={"path": "m"}, data={"dataset": "d"}, method="grpo", graft={"peer_models": []})
    with pytest.raises(ValidationError, match="trust_unverified_mu with graft.require_behaviour_logprobs"):
        # the store serves no rescored_unverified group under the second: the first would change nothing
        TrainConfig(model={"path": "m"}, data={"dataset": "d"}, method="grpo",
                    graft={"trust_unverified_mu": True, "require_behaviour_logprobs": True})
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides({}, ["graft.peer_negative_scale"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(TrainConfig, tmp_path / "missing.yaml")


BASE = {"model": {"path": "m"}, "data": {"dataset": "d"}, "store": {"url": "http://x"}}


@pytest.mark.parametrize(("given", "source", "publishes"), [
    ({}, "prefetch", False),
    ({"peers": {"publish": True}}, "prefetch", True),  # a section without a source is prefetch's
    ({"peers": {"source": "cotrain", "wait_s": 5}}, "cotrain", True),
    ({"peers": {"source": "lockstep"}, "graft": {"peer_models": ["p"]}}, "lockstep", True),
    ({"peers": {"source": "replay", "run_dir": "runs/graft"}}, "replay", False),
])
def test_one_setting_names_how_peers_arrive(given, source, publishes):
    cfg = TrainConfig.model_validate({**BASE, **given})
    assert (cfg.peers.source, cfg.publishes, cfg.co_trains) == (source, publishes, source in ("cotrain", "lockstep"))
    assert TrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # a run's config.yaml loads back


@pytest.mark.parametrize(("given", "says"), [
    # a setting of another source would do nothing: refused, naming what the source takes
    ({"peers": {"source": "cotrain", "lookup_wait_s": 5}}, "peers.lookup_wait_s with peers.source cotrain: not a setting"),
    ({"peers": {"source": "prefetch", "partner_timeout_s": 5}}, "it takes lookup_wait_s, publish"),
    ({"peers": {"source": "bogus"}}, "does not match any of the expected tags"),
    ({"peers": {"source": "replay"}}, "run_dir"),
    # what only GRAFT does
    ({"method": "grpo", "peers": {"source": "cotrain"}}, "only GRAFT takes peer groups"),
    ({"method": "grpo", "store": {"url": None}, "peers": {"publish": True}}, "publishes this run's groups: it needs store.url"),
    # lockstep and replay promise groups that do not depend on timing
    ({"peers": {"source": "lockstep"}}, "needs graft.peer_models"),
    ({"peers": {"source": "lockstep"}, "graft": {"peer_models": ["p"], "max_peer_age_s": 60}}, "wall-clock bound"),
    ({"peers": {"source": "replay", "run_dir": "r"}, "parallel": {"strategy": "ddp"}}, "not supported under parallel"),
    # the old keys mean nothing beside the new section, and co-training without publishing means nothing at all
    ({"store": {"url": "http://x", "mode": "cotrain"}, "peers": {"source": "cotrain"}}, "beside a peers section"),
    ({"store": {"url": "http://x", "mode": "cotrain", "publish": False}}, "a co-trainer publishes its groups"),
    ({"store": {"url": "http://x", "mode": "cotrain", "lookup_wait_s": 5}}, "prefetch's wait"),
])
def test_sources_are_refused_where_they_would_do_nothing_or_could_not_hold(given, says):
    with pytest.raises(ValidationError, match=says):
        TrainConfig.model_validate({**BASE, **given})


@pytest.mark.parametrize(("old", "peers"), [
    ({"mode": "offline", "lookup_wait_s": 2.0, "cotrain_lockstep": True}, {"source": "prefetch", "lookup_wait_s": 2.0}),
    ({"mode": "offline", "publish": True}, {"source": "prefetch", "publish": True}),
    ({"mode": "cotrain", "cotrain_wait_s": 120, "cotrain_poll_s": 0.5}, {"source": "cotrain", "wait_s": 120, "poll_s": 0.5}),
    ({"mode": "cotrain", "cotrain_lockstep": True, "cotrain_wait_s": 120}, {"source": "lockstep", "partner_timeout_s": 120}),
    ({"replay_from": "runs/graft", "mode": "cotrain"}, {"source": "replay", "run_dir": "runs/graft"}),
])
def test_the_old_store_keys_are_read_as_the_source_they_meant_said_out_loud(old, peers):
    """store.mode, cotrain_lockstep, replay_from, publish and the waits of earlier releases (a run's config.yaml, the
    demo's --set lines): mapped to the peers section, with a warning naming it; a lone store section refuses them."""
    with pytest.warns(FutureWarning, match="these keys are gone, read as peers"):
        cfg = TrainConfig.model_validate({**BASE, "store": {"url": "http://x", **old}, "graft": {"peer_models": ["p"]}})
    assert cfg.peers.model_dump(mode="json", exclude_defaults=True) | {"source": peers["source"]} == peers
    with pytest.raises(ValidationError, match="how peer groups arrive is one setting now, peers.source"):
        StoreConfig.model_validate({"url": "http://x", **old})


def test_graft_train_takes_the_source_as_a_flag_and_refuses_the_old_flags():
    runner = CliRunner()
    result = runner.invoke(app, ["show-config", "--config", str(CONFIGS / "train_toy.yaml"), "--set", "peers.source=cotrain"])
    assert result.exit_code == 0, result.output
    assert "source: cotrain" in result.output and "peers.partner_timeout_s" in result.output  # every source's settings
    result = _toy_dry_run("--cotrain")
    assert result.exit_code == 2 and "--peers cotrain" in result.output


def test_the_store_as_a_broker_is_set_where_it_does_something():
    """store.want_misses and the serving policy: off by default; refused where they would do nothing (no lookups) or
    would stall lockstep co-training; a cap of 0 (serving nothing) refused."""
    base = {"model": {"path": "m"}, "data": {"dataset": "d"}}
    cfg = TrainConfig(**base, store={"url": "http://x"})
    assert not cfg.store.want_misses and cfg.store.max_times_served is None and cfg.store.serve_order == "freshest"
    assert not cfg.store.records_served
    cfg = TrainConfig(**base, store={"url": "http://x", "want_misses": True, "max_times_served": 2})
    assert cfg.store.records_served
    assert TrainConfig(**base, store={"url": "http://x", "serve_order": "least_served"}).store.records_served
    assert not TrainConfig(**base, store={"url": "http://x", "serve_order": "most_successes"}).store.records_served
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        TrainConfig(**base, store={"url": "http://x", "max_times_served": 0})
    for store in ({"want_misses": True}, {"max_times_served": 3}, {"serve_order": "least_served"}):
        with pytest.raises(ValidationError, match="only GRAFT looks peer groups up"):
            TrainConfig(**base, method="grpo", store={"url": "http://x", **store})
        with pytest.raises(ValidationError, match="with peers.source lockstep"):
            TrainConfig(**base, graft={"peer_models": ["p"]}, peers={"source": "lockstep"}, store={"url": "http://x", **store})


def test_every_field_is_documented():
    rows = describe_fields(TrainConfig)
    assert len(rows) > 60
    undocumented = [name for name, _, doc in rows if not doc]
    assert not undocumented


def test_cli_show_config_and_validation_errors():
    runner = CliRunner()
    result = runner.invoke(app, ["show-config", "--config", str(CONFIGS / "train_toy.yaml"), "--set", "graft.token_is=none"])
    assert result.exit_code == 0, result.output
    assert "graft.peer_negative_scale" in result.output and "token_is: none" in result.output
    result = runner.invoke(app, ["train", "--config", str(CONFIGS / "train_toy.yaml"), "--set", "graft.token_is=bogus"])
    assert result.exit_code != 0 and "graft.token_is" in result.output


def _toy_dry_run(*args: str):
    return CliRunner().invoke(app, ["train", "--config", str(CONFIGS / "train_toy.yaml"), *args, "--dry-run"])


def test_dry_run_fails_naming_each_input_path_that_is_not_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # train_toy.yaml's paths are relative: nothing of the demo's is here
    result = _toy_dry_run("--model", str(tmp_path / "no-model"))
    assert result.exit_code != 0
    for field in ("model.path", "data.dataset", "anchor.dataset"):
        assert field in result.output, result.output
    assert "no-model" in result.output


def test_train_toy_names_the_files_make_demo_writes(tmp_path, monkeypatch):
    """configs/train_toy.yaml after `make demo`: its data and anchor are the demo's own files, and the --model its
    header shows (the learner's warm start, in a folder named by its config's hash) is where the demo puts it."""
    from demo.config import DemoConfig, warm_start_checkpoint
    from demo.run import prepare_data

    monkeypatch.chdir(tmp_path)
    prepare_data(DemoConfig(), Path("demo_out/data"))
    learner = warm_start_checkpoint(Path("demo_out/models/learner-0123abcd"), "early")
    header = (CONFIGS / "train_toy.yaml").read_text()
    assert 'ls -d demo_out/models/learner-*/starts/early' in header and learner.match("demo_out/models/learner-*/starts/early")
    learner.mkdir(parents=True)
    result = _toy_dry_run("--model", str(learner))
    assert result.exit_code == 0, result.output
    assert "dataset: demo_out/data/toy-rl.jsonl" in result.output


def test_a_smaller_prompt_batch_names_the_setting_to_change_with_it():
    result = _toy_dry_run("--prompts-per-step", "4")
    assert result.exit_code != 0 and "--set optim.mini_batch_prompts=4" in result.output, result.output


def test_dry_run_reads_the_training_data_and_names_its_columns(tmp_path, monkeypatch):
    """A raw GSM8K file (question, answer ending in '#### 7'): refused in one line that names the setting, then read
    with data.problem_field; the instruction and system prompt are settable and a system prompt that would do
    nothing (template plain) is refused."""
    monkeypatch.chdir(tmp_path)
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\\n#### 7"}\n')
    model = tmp_path / "model"
    model.mkdir()
    args = ["--model", str(model), "--dataset", str(raw), "--set", "anchor.dataset=null"]
    refused = _toy_dry_run(*args)
    assert refused.exit_code != 0 and "data.problem_field=question" in refused.output, refused.output
    assert "Traceback" not in refused.output
    read = _toy_dry_run(*args, "--set", "data.problem_field=question", "--set", "prompt.template=auto",
                        "--set", "prompt.system_prompt=Be brief.", "--set", "prompt.instruction=Box it.")
    assert read.exit_code == 0, read.output
    assert "problem_field: question" in read.output and "system_prompt: Be brief." in read.output
    plain = _toy_dry_run(*args, "--set", "data.problem_field=question", "--set", "prompt.template=plain",
                         "--set", "prompt.system_prompt=Be brief.")
    assert plain.exit_code != 0 and "system_prompt" in plain.output


def test_the_learners_prompt_is_the_generators_section_and_the_old_keys_are_refused():
    """Issue 59: the learner's `data.prompt_template` and the peer's `template` named one thing apart; both are the
    `prompt` section now (PromptConfig, one validator), and the data section's old keys are refused naming it."""
    from graft.rollouts.prompts import PromptConfig
    from graft.services.generator.config import GeneratorConfig

    base = {"model": {"path": "m"}, "data": {"dataset": "d"}, "method": "grpo"}
    cfg = TrainConfig.model_validate({**base, "prompt": {"template": "plain", "few_shot": 2}})
    assert type(cfg.prompt) is PromptConfig is type(GeneratorConfig(model="m", dataset="d", store="s").prompt)
    with pytest.raises(ValidationError, match=r"data.prompt_template: now prompt.template; data.system_prompt: now "
                                              r"prompt.system_prompt \(keys of an earlier release"):
        TrainConfig.model_validate({**base, "data": {"dataset": "d", "prompt_template": "raw", "system_prompt": "x"}})
    with pytest.raises(ValidationError, match="template 'raw' shows the problem verbatim and takes no worked examples"):
        TrainConfig.model_validate({**base, "prompt": {"template": "raw", "few_shot": 2}})


def test_a_graft_preset_names_the_formulas_and_refuses_a_clash():
    """graft.preset sets the fields of GRAFT's per-token weight by name (the spec's formulas stay one name away
    whatever the default is) and refuses another value of them beside it, saying which."""
    from graft.trainer.config import GRAFT_PRESETS, GraftOptions

    for name, fields in GRAFT_PRESETS.items():
        graft = GraftOptions(preset=name)
        assert {field: getattr(graft, field) for field in fields} == fields
        assert GraftOptions.model_validate(graft.model_dump()) == graft  # a saved config loads back
    assert GraftOptions(preset="spec").token_is == "tis" and GraftOptions(preset="b1_no_peer_neg").token_is == "none"
    with pytest.raises(ValueError, match="peer_negative_scale"):
        GraftOptions(preset="spec", peer_negative_scale=0.0)
    with pytest.raises(ValueError):
        GraftOptions(preset="no_such_preset")


@pytest.mark.parametrize("field, value", [("is_cap", 5.0), ("log_rho_min", -2.0), ("max_grafted_fraction", 1.0),
                                          ("union_all_success", True), ("kl_on_peer", True)])
def test_the_spec_preset_pins_every_field_the_spec_names(field, value):
    """Issue 60: `preset: spec` left is_cap (the spec's C = 2), log_rho_min (no floor) and group_normalized_weight
    (off) to the defaults, so `preset: spec` with `is_cap: 5` ran other formulas under the spec's name."""
    from graft.trainer.config import GRAFT_PRESETS, GraftOptions

    named = {"token_is", "is_cap", "kappa", "log_rho_min", "peer_negative_scale", "group_normalized_weight",
             "union_all_success", "kl_on_peer", "max_grafted_fraction"}  # docs/algorithm.md sections 1, 4, 5, 6
    assert named <= set(GRAFT_PRESETS["spec"])
    with pytest.raises(ValueError, match=field):
        GraftOptions(preset="spec", **{field: value})
    assert GraftOptions(preset="spec").is_cap == 2.0 and GraftOptions(preset="spec").group_normalized_weight is False
