"""TEST-ONLY CODE: verl's actor (`TrainingWorker`, FSDP2, `ppo_loss`) in one CPU process, which verl does not support
(it has no CPU platform and registers its FSDP engine for cuda/npu only). The shim below adds both and starts gloo, then
the real worker trains on a batch the test saved: nothing here is part of integrations/verl, and a verl upgrade may
break it (it touches verl's platform registry, engine registry and distributed start-up).

`python cpu_actor.py IN.pt OUT.pt`: IN holds the verl config's overrides and the batch's fields (a TensorDict: one
data-parallel rank's, with what verl's `_update_actor` puts in its extra_info, or the defaults below); OUT gets the
parameters before and after one `train_mini_batch`. Data parallel: one process per rank, RANK, WORLD_SIZE and
MASTER_PORT set by the caller (gloo between them); rank 0 writes OUT."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import types
from functools import partial


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


os.environ.update(VERL_PLATFORM="cpu", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
for _name, _value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", None)):
    os.environ.setdefault(_name, _value or str(_free_port()))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.plugin.platform.platform_manager import PlatformRegistry  # noqa: E402


class _CPUModule(types.ModuleType):
    """torch.cpu plus what verl's metrics read of a device after each update (name, memory: a CPU reports none)."""

    def __getattr__(self, name):
        if name == "get_device_name":
            return lambda *args, **kwargs: "cpu"
        if name == "mem_get_info":
            return lambda *args, **kwargs: (0, 0)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return lambda *args, **kwargs: 0  # memory counters (max_memory_allocated, memory_reserved, ...)


_CPU_MODULE = _CPUModule("verl_cpu_shim")


@PlatformRegistry.register(platform="cpu")
class CPUPlatform(PlatformBase):
    """verl's platform interface on the CPU: one device, gloo, nothing to profile."""

    device_name = "cpu"
    vendor_name = "cpu"

    def __init__(self):
        pass

    @property
    def device_module(self):
        return _CPU_MODULE

    def is_available(self): return True
    def current_device(self): return "cpu"  # fsdp_utils moves tensors to it
    def device_count(self): return 1
    def set_device(self, index): pass
    def synchronize(self, index=None): pass
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def get_device_capability(self, index=0): return (None, None)
    def communication_backend_name(self): return "gloo"
    def visible_devices_envvar(self): return "CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self): pass
    def profiler_stop(self): pass
    def ray_resource_name(self): return "CPU"
    def ray_noset_envvars(self): return []
    def is_ipc_supported(self): return False
    def cudart(self): return None


def main(source: str, target: str) -> None:
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.engine import TrainingWorkerConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl_world import verl_config

    torch.set_num_threads(1)
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)  # verl would ask for cpu:gloo,cpu:nccl
    saved = torch.load(source, weights_only=False)
    config = verl_config(saved["overrides"])
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor.model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    worker_config = TrainingWorkerConfig(model_type="language_model", model_config=actor.model_config,
                                         engine_config=actor.engine, optimizer_config=actor.optim,
                                         checkpoint_config=actor.checkpoint)
    worker_config.engine_config.use_dynamic_bsz = False  # as verl's ActorRolloutRefWorker.init_model sets them
    worker_config.engine_config.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    worker_config.engine_config.infer_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    worker = TrainingWorker(config=worker_config)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))

    def parameters() -> dict[str, torch.Tensor]:
        return {name: p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                for name, p in worker.engine.module.named_parameters()}

    before = parameters()
    batch = saved["batch"]
    size = len(batch) * world
    # what verl's _update_actor puts in extra_info (trainer_base.py:1797-1809) where the batch has none: one
    # mini-batch, one epoch
    defaults = dict(calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                    global_batch_size=size, mini_batch_size=size, epochs=1, seed=0, dataloader_kwargs={"shuffle": False},
                    temperature=1.0, use_dynamic_bsz=False, micro_batch_size_per_gpu=actor.ppo_micro_batch_size_per_gpu)
    tu.assign_non_tensor(batch, **{key: value for key, value in defaults.items() if key not in batch.keys()})
    output = worker.train_mini_batch(batch)
    after = parameters()  # a collective under data parallelism: every rank gathers
    if rank == 0:
        torch.save({"before": before, "after": after, "metrics": tu.get(output, "metrics")}, target)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], sys.argv[2])
