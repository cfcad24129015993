"""The demo's numbers hold under every kernel choice of one x86-64 machine (issue 25; two CPU models still differ,
docs/demo.md): the learner's warm start through `demo.worker build`, in the
demo's job environment (`demo.jobs.child_env`), gives the same weights and accuracies, bit for bit, on two emulated CPUs.

The two CPUs are emulated on this one by the variables that choose the kernels: ATen's AVX2 kernels with MKL's own
choice of sgemm (this machine as it is), and ATen's baseline x86-64 kernels with MKL's SSE2 branch (a CPU whose MKL
path is another one, or an x86-64 without AVX). The second test checks that they differ without the pin, so that the
first one can fail."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from demo.config import DemoConfig, quick
from demo.jobs import child_env, portable_kernels_available
from demo.run import prepare_data

REPO = Path(__file__).resolve().parents[2]
EMULATED_CPUS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AUTO"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}

pytestmark = pytest.mark.skipif(
    not portable_kernels_available() or torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="emulating two x86-64 CPUs needs an x86-64 CPU with AVX2 (and no ATEN_CPU_CAPABILITY=default in the test's environment)",
)


def warm_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, portable_kernels: bool) -> dict[str, tuple[str, dict]]:
    """{emulated CPU: (sha256 of the warm-started weights, done.json without its timings)}, the two built at once."""
    data = quick(DemoConfig()).model_dump()
    data["task"].update(n_eval={"add2": 4, "add3": 4}, n_dev=4)
    data["learner"]["sft"].update(steps=4, batch_size=32)  # the demo's learner (128 wide, 4 layers), a few steps
    cfg = DemoConfig.model_validate(data)
    paths = prepare_data(cfg, tmp_path / "data")
    eval_sets = {f: str(paths[f"eval_{f}"]) for f in cfg.task.n_eval}
    running = {}
    for name, variables in EMULATED_CPUS.items():
        out = tmp_path / ("pinned" if portable_kernels else "host") / name
        out.mkdir(parents=True)
        job = out / "job.json"
        job.write_text(json.dumps({"role": "learner", "out": str(out), "demo": cfg.model_dump(mode="json"), "eval_sets": eval_sets,
                                   "threads": 1}))
        with monkeypatch.context() as m:
            for key, value in variables.items():
                m.setenv(key, value)
            env = child_env(portable_kernels=portable_kernels)
        log = open(out / "log.txt", "wb")
        running[name] = (out, log, subprocess.Popen([sys.executable, "-m", "demo.worker", "build", str(job)], cwd=REPO, env=env,
                                                    stdout=log, stderr=subprocess.STDOUT))
    results = {}
    for name, (out, log, proc) in running.items():
        code = proc.wait(timeout=600)
        log.close()
        assert code == 0, (out / "log.txt").read_text()[-3000:]
        done = json.loads((out / "done.json").read_text())
        start = done["starts"]["early"]
        weights = hashlib.sha256((Path(start["checkpoint"]) / "model.safetensors").read_bytes()).hexdigest()
        starts = {n: {k: v for k, v in s.items() if k != "checkpoint"} for n, s in done["starts"].items()}
        results[name] = (weights, {k: v for k, v in done.items() if k not in ("starts", "sft_s", "wall_s", "cpu_s", "record")}
                         | {"starts": starts})  # (the record: when and on which kernels it ran)
    return results


@pytest.mark.slow
def test_the_portable_kernels_give_one_warm_start_on_two_cpus(tmp_path, monkeypatch):
    results = warm_starts(tmp_path, monkeypatch, portable_kernels=True)
    assert results["avx2"] == results["baseline"]


@pytest.mark.slow
def test_without_the_pin_the_two_cpus_train_other_weights(tmp_path, monkeypatch):
    """The emulation changes the arithmetic: the test above would fail if the jobs ran on each CPU's own kernels."""
    results = warm_starts(tmp_path, monkeypatch, portable_kernels=False)
    assert results["avx2"][0] != results["baseline"][0]
