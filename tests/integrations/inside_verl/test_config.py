"""The verl settings GRAFT refuses (each naming the setting and why), checked on verl's own config by the trainer's
constructor before verl starts anything; graft-train's configuration of a verl run; the plugin's registration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer", reason="verl runs in its own environment: make install-verl, then .venv-verl/bin/python -m pytest")

from verl_world import graft_overrides, verl_config  # noqa: E402

from graft.integrations.verl.config import check_config, graft_section, train_config  # noqa: E402
from graft.integrations.verl.trainer import GraftPPOTrainer  # noqa: E402
from graft.trainer.config import LOOKUP_WAIT_S  # noqa: E402

STORE = "http://127.0.0.1:8600"
# a fresh user's environment has none of the test-only CPU shim's settings (cpu_actor.py sets VERL_PLATFORM=cpu and
# the torch.distributed variables when pytest imports it, e.g. `pytest tests/integrations/inside_verl/*.py`)
SHIM = {"PYTHONPATH", "VERL_PLATFORM", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def config(*extra: str):
    return verl_config(graft_overrides(Path("/models/learner"), STORE, None) + list(extra))


@pytest.mark.parametrize("settings, named", [
    (["algorithm.adv_estimator=gae"], "adv_estimator"),
    (["algorithm.rollout_correction.bypass_mode=true"], "bypass_mode"),
    (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs"),
    (["algorithm.filter_groups.enable=true"], "filter_groups"),
    (["algorithm.use_kl_in_reward=true"], "use_kl_in_reward"),
    (["actor_rollout_ref.actor.use_kl_loss=true"], "kl_on_peer"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], "loss_mode"),
    (["actor_rollout_ref.actor.loss_agg_mode=token-sum"], "loss_agg_mode"),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"], "loss_scale_factor"),
    (["actor_rollout_ref.actor.entropy_coeff=0.01"], "entropy"),
    (["actor_rollout_ref.rollout.multi_turn.enable=true"], "multi_turn"),
    (["+trainer.v1.graft_sync.parameter_sync_step=4"], "async"),
    (["+trainer.v1.sync.parameter_sync_step=4"], "trainer.v1.sync.parameter_sync_step"),  # the key verl reads
    (["actor_rollout_ref.rollout.n=1"], "rollout.n=1"),
    (["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"], "routing_replay"),
    (["skip.rollout_tq.enable=true"], "rollout_tq"),
    (["graft.options.token_is=luffy"], "luffy"),  # the tests' settings name token_is already (verl_world)
    (["+graft.options.union_all_success=true"], "union_all_success"),
    (["+graft.store_options.mode=cotrain"], "peers.source"),  # how peers arrive is no store option
    (["+graft.store_options.replay_from=runs/graft"], "peers.source"),  # was accepted and ignored
    (["+graft.peer_source=lockstep"], "fixed set of prompts"),  # the sources verl's loop cannot run, with why
    (["+graft.peer_source=replay"], "graft-train replay"),
    (["+graft.peer_source=cotrain", "+graft.lookup_wait_s=5"], "prefetch's wait"),  # a setting that would do nothing
    (["+graft.peer_source=cotrain", "+graft.publish=false"], "a co-trainer publishes"),
    (["+graft.peer_options.partner_timeout_s=5"], "partner_timeout_s"),  # another source's setting
    (["+graft.options.kapa=1.0"], "kapa"),  # graft-train's own validation: a typo fails
    (["+graft.stor_url=x"], "stor_url"),
    (["+graft.peer_tokenizers=['tok-1=/a','/b']"], "ID=DIR"),
    # an agent loop of the run's own may score its rollouts itself: the learner's reward of grafted rows must be stated
    (["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"], "peer_reward_map"),
    (["actor_rollout_ref.rollout.agent.agent_loop_config_path=/x.yaml"], "peer_reward_map"),
])
def test_the_trainer_refuses_what_graft_cannot_do_inside_verl(settings, named):
    with pytest.raises(ValueError, match=named):
        GraftPPOTrainer(config(*settings))


def test_graft_settings_without_a_store_are_refused():
    """graft.* without graft.store_url would graft nothing: refused, not a plain verl run."""
    with pytest.raises(ValueError, match="without graft.store_url"):
        GraftPPOTrainer(verl_config(graft_overrides(Path("/models/learner"), None, Path("/models/peer"))))


def test_an_agent_loop_of_the_runs_own_runs_with_a_stated_reward_map():
    cfg = config("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "+graft.peer_reward_map={0:-1,1:1}")
    check_config(cfg)
    assert graft_section(cfg).peer_reward_map == {0.0: -1.0, 1.0: 1.0}


def test_peer_tokenizer_ids_are_given_as_docs_verl_md_shows_them_in_a_shell():
    """docs/verl.md's peer tokenizer block (walk: skip tested, this test): each command line split as a POSIX shell
    splits it (shlex), its graft overrides composed into verl's config. One override per peer needs no quoting; the list
    form works with the whole override quoted, and fails unquoted (the shell strips the quotes Hydra needs)."""
    import re
    import shlex

    page = (Path(__file__).parents[3] / "docs" / "verl.md").read_text()
    block = re.search(r"<!-- walk: skip tested tests/integrations/inside_verl/test_config.py[^>]*-->\n```bash\n(.*?)```",
                      page, re.S).group(1)
    lines = [line for line in block.splitlines() if line.startswith("python -m verl.trainer.main_ppo")]
    assert len(lines) == 2
    for line in lines:
        overrides = [word for word in shlex.split(line) if word.startswith("+graft.")]
        peers = train_config(config(*overrides)).graft.peer_tokenizers
        assert peers == {"tok-1a2b3c": "/models/peer-a", "tok-9f8e7d": "/models/peer-b"}, line
    unquoted = lines[1].replace("'+graft", "+graft").rstrip("'")
    with pytest.raises(Exception, match="tok-1a2b3c="):
        config(*[word for word in shlex.split(unquoted) if word.startswith("+graft.")])


def test_the_logged_config_names_graft_sync_while_verl_runs_its_sync_mode():
    """verl's base constructor sees `sync` (its replay buffer, checkpoints); the config, which verl's `fit` hands its
    logger (Tracking), keeps trainer_mode graft_sync."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    trainer = GraftPPOTrainer(config())
    assert trainer.trainer_mode == "sync" and type(trainer.replay_buffer) is ReplayBuffer
    assert OmegaConf.to_container(trainer.config, resolve=True)["trainer"]["v1"]["trainer_mode"] == "graft_sync"


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_verls_other_v1_trainers_refuse_graft_settings(mode):
    """`trainer.v1.trainer_mode` other than graft_sync builds one of verl's own trainers, which would ignore graft.*:
    each refuses it in one line (the plugin's guard); without graft.* it is verl's, as ever."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    with pytest.raises(ValueError, match=f"graft.store_url.*is set, but trainer.v1.trainer_mode={mode} .* does not graft"):
        get_trainer_cls(mode)(config(f"trainer.v1.trainer_mode={mode}"))
    if mode == "colocate_async":
        plain = verl_config(graft_overrides(Path("/models/learner"), None, None) + [f"trainer.v1.trainer_mode={mode}"])
        assert get_trainer_cls(mode)(plain).trainer_mode == mode


def test_verls_v0_trainer_refuses_graft_settings():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    with pytest.raises(ValueError, match="v0 trainer.*does not graft"):
        RayPPOTrainer(config=config("trainer.use_v1=false"), tokenizer=None, role_worker_mapping={},
                      resource_pool_manager=None)


@pytest.mark.parametrize("module", ["verl.experimental.fully_async_policy.fully_async_main",
                                    "verl.experimental.one_step_off_policy.main_ppo"])
def test_verls_experimental_entry_points_refuse_graft_settings_before_ray_starts(module):
    """verl's experimental entry points build trainers of their own (not through the v1 registry): run as a user runs
    them, with +graft.*, each stops in one line naming what to run instead, before Ray starts."""
    import verl

    env = {k: v for k, v in os.environ.items() if k not in SHIM}
    # their configs find verl's ppo_trainer config as file://verl/trainer/config: run where verl's package is
    run = subprocess.run([sys.executable, "-m", module, f"+graft.store_url={STORE}"], env=env,
                         cwd=Path(verl.__file__).parents[1], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "ValueError: graft.store_url is set, but this entry point's task runner" in run.stderr, run.stderr[-3000:]
    assert "trainer.v1.trainer_mode=graft_sync" in run.stderr and "ray init kwargs" not in run.stdout


def test_verls_default_attention_without_flash_attn_is_refused_with_the_fix():
    """verl's actor asks for flash_attention_2 unless told otherwise; verl[vllm] brings no flash-attn."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here: verl's default attention works")
    unset = [o for o in graft_overrides(Path("/models/learner"), STORE, None) if "attn_implementation" not in o]
    with pytest.raises(ValueError, match="attn_implementation=sdpa"):
        GraftPPOTrainer(verl_config(unset))
    check_config(verl_config(unset + ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]))


def test_what_graft_accepts_with_its_reason_to():
    cfg = train_config(config("actor_rollout_ref.actor.use_kl_loss=true", "+graft.options.kl_on_peer=true",
                              "actor_rollout_ref.actor.kl_loss_coef=0.02", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                              "algorithm.norm_adv_by_std_in_grpo=false", "+graft.options.kappa=0.5",
                              "+graft.peer_tokenizers=['tok-1=/models/peer']", "+graft.store_options.timeout_s=3"))
    assert cfg.method == "graft" and cfg.store.url == STORE and cfg.store.timeout_s == 3 and not cfg.publishes
    assert cfg.peers.source == "prefetch" and cfg.peers.lookup_wait_s == LOOKUP_WAIT_S  # graft-train's, as TRL's
    co = train_config(config("+graft.peer_source=cotrain", "+graft.peer_options.wait_s=60",
                             "+graft.store_options.want_misses=true", "+graft.store_options.serve_order=least_served"))
    assert co.peers.source == "cotrain" and co.peers.wait_s == 60 and co.publishes and co.store.want_misses
    assert train_config(config("+graft.publish=true")).publishes
    assert cfg.graft.kappa == 0.5 and cfg.graft.peer_tokenizers == {"tok-1": "/models/peer"}
    assert (cfg.ppo.eps_low, cfg.ppo.eps_high, cfg.ppo.dual_clip_c, cfg.ppo.kl_beta) == (0.2, 0.28, 3.0, 0.02)
    assert cfg.ppo.advantage == "dr_grpo" and cfg.ppo.loss_agg == "token-mean"
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.rollout.max_response_tokens) == (4, 3, 16)
    plain = verl_config(graft_overrides(Path("/models/learner"), None, None) + ["algorithm.adv_estimator=gae"])
    assert train_config(plain).method == "grpo"  # no store: verl's trainer as it is, nothing refused


def test_importing_verl_registers_graft_sync_through_the_entry_point():
    """A fresh process that imports verl finds graft_sync (the verl.plugins entry point in pyproject), outside the
    checkout too; with VERL_USE_EXTERNAL_MODULES a module that fails to import stops verl loudly."""
    code = ("import verl; from verl.trainer.ppo.v1 import get_trainer_cls; "
            "assert get_trainer_cls('colocate_async').__init__.graft_guard; "  # the plugin's guard (guard.py)
            "print(get_trainer_cls('graft_sync').__module__)")
    env = {k: v for k, v in os.environ.items() if k not in SHIM}
    found = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0 and found.stdout.strip().endswith("graft.integrations.verl.trainer"), found.stderr[-2000:]
    loud = subprocess.run([sys.executable, "-c", "import verl"], cwd="/", capture_output=True, text=True, timeout=300,
                          env=dict(env, VERL_USE_EXTERNAL_MODULES="graft.integrations.verl.no_such_module"))
    assert loud.returncode != 0 and "no_such_module" in loud.stderr


def test_the_verl_trainer_runs_graft_trains_default_graft():
    """With no graft.options the verl run grafts with graft-train's default GRAFT, field for field (TRL's adapter: the
    same check in tests/integrations/test_trl.py): a change of the default moves every trainer at once."""
    from graft.trainer.config import GraftOptions

    bare = [o for o in graft_overrides(Path("/models/learner"), STORE, None) if not o.startswith("+graft.options")]
    mine = {"peer_tokenizers"}  # the run's own (an empty list or map: none)
    assert train_config(verl_config(bare)).graft.model_dump(exclude=mine) == GraftOptions().model_dump(exclude=mine)


def test_the_gpu_stage_fails_a_run_that_grafted_nothing():
    """gpu_check/verl_stage.py's verdict: every step's lookup answered in time and some step grafted; three steps
    that grafted nothing (the learner solved every prompt, say) prove nothing of the weights: not a pass."""
    from gpu_check.verl_stage import STEPS, passed

    step = {"graft/frac_grafted": 0.0, "graft/store_lookups_late": 0, "graft/store_lookup_failures": 0}
    assert not passed(0, [dict(step, step=k) for k in range(STEPS)])
    assert passed(0, [dict(step, step=0, **{"graft/frac_grafted": 0.25})] + [dict(step, step=k) for k in range(1, STEPS)])
    assert not passed(0, [dict(step, step=0, **{"graft/frac_grafted": 0.25, "graft/store_lookups_late": 1})]
                      + [dict(step, step=k) for k in range(1, STEPS)])
