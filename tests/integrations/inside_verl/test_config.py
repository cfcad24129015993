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

from graft.integrations.verl.config import check_config, train_config  # noqa: E402
from graft.integrations.verl.trainer import GraftPPOTrainer  # noqa: E402

STORE = "http://127.0.0.1:8600"


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
    (["+graft.peer_source=cotrain"], "co-training"),  # every source the trainer does not run
    (["+graft.store_options.max_times_served=2"], "max_times_served"),  # the adapter posts no grafts to the ledger
    (["+graft.options.kapa=1.0"], "kapa"),  # graft-train's own validation: a typo fails
    (["+graft.stor_url=x"], "stor_url"),
    (["+graft.peer_tokenizers=['tok-1=/a','/b']"], "ID=DIR"),
])
def test_the_trainer_refuses_what_graft_cannot_do_inside_verl(settings, named):
    with pytest.raises(ValueError, match=named):
        GraftPPOTrainer(config(*settings))


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
    assert cfg.peers.source == "prefetch" and cfg.peers.lookup_wait_s == 30
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
            "print(get_trainer_cls('graft_sync').__module__)")
    # a fresh user's environment: none of the test-only CPU shim's settings (cpu_actor.py sets VERL_PLATFORM=cpu and
    # the torch.distributed variables when pytest imports it, e.g. `pytest tests/integrations/inside_verl/*.py`)
    shim = {"PYTHONPATH", "VERL_PLATFORM", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in shim}
    found = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0 and found.stdout.strip().endswith("graft.integrations.verl.trainer"), found.stderr[-2000:]
    loud = subprocess.run([sys.executable, "-c", "import verl"], cwd="/", capture_output=True, text=True, timeout=300,
                          env=dict(env, VERL_USE_EXTERNAL_MODULES="graft.integrations.verl.no_such_module"))
    assert loud.returncode != 0 and "no_such_module" in loud.stderr


def test_the_verl_trainer_runs_graft_trains_default_graft():
    """With no graft.options the verl run grafts with graft-train's default GRAFT, field for field (TRL's adapter: the
    same check in tests/integrations/test_trl.py): a change of the default moves every trainer at once."""
    from graft.trainer.config import GraftConfig as GraftOptions

    bare = [o for o in graft_overrides(Path("/models/learner"), STORE, None) if not o.startswith("+graft.options")]
    mine = {"peer_tokenizers"}  # the run's own (an empty list or map: none)
    assert train_config(verl_config(bare)).graft.model_dump(exclude=mine) == GraftOptions().model_dump(exclude=mine)
