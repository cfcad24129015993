"""One graft-train run grafts from each kind of file users bring (issue 56): a real TRL 1.16 run's completions
(conversational, num_iterations 2, an eval set), verl 0.9.1's own rollout dump scored by its gsm8k reward (`#### N`),
and an OpenR1-Math-220k-shaped trace set as the Hub exports it. Each is imported by its own rule into groups keyed by
the learner's problems; the learner is the toy peer (a byte-level tokenizer: any text re-tokenises), which fails the
toy learner's family, where the imported groups are: its metrics must name a grafted group of every source."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import orjson
import pytest
from train_configs import make_config

from graft.services.generator.config import ImportConfig
from graft.services.generator.importing import run_import
from graft.services.store_api.http.testing import StoreServer
from graft.trainer.loop import train

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"


def verl_rollout_dump(tokenizer_dir: Path, problems, out: Path) -> Path:
    """verl's own dump (tests/generator/verl_dump.py) of answers in GSM8K's format, two right and two wrong a problem."""
    if not VERL_PYTHON.exists():
        if os.environ.get("GRAFT_REQUIRE_VERL"):
            pytest.fail(f"{VERL_PYTHON} is absent and GRAFT_REQUIRE_VERL is set: make install-verl")
        pytest.skip(f"{VERL_PYTHON} is absent: make install-verl builds verl's environment")
    groups = [{"problem": p.problem, "gold": p.answer,
               "completions": [f"#### {p.answer}", f"#### {int(p.answer) + 1}", f"so #### {p.answer}", "#### 0"]}
              for p in problems]
    spec = out.parent / "verl_spec.json"
    spec.write_text(json.dumps({"tokenizer": str(tokenizer_dir), "out": str(out), "step": 7, "groups": groups,
                                "data_source": "openai/gsm8k", "response_length": 16}))
    proc = subprocess.run([str(VERL_PYTHON), str(ROOT / "tests" / "generator" / "helpers" / "verl_dump.py"), str(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_one_run_grafts_trl_verl_and_trace_set_groups(toy_world, tiny_model_dir, tmp_path):
    pytest.importorskip("trl", reason="the trl extra is not installed: pip install '.[trl]'")
    from trl_files import run_trl

    from testbed.trace_sets import OpenR1Row, openr1_dataset, parquet_export

    family = toy_world.learner_problems  # the toy peer, the learner here, has no skill on these
    root = tmp_path / "store"
    common = {"store": str(root), "problems": str(toy_world.problems_path), "scoring": {"workers": 1}}

    run = run_trl(toy_world.learner_dir, family[:6], family[6:7], tmp_path / "trl-grpo")
    trl = run_import(ImportConfig(files=[str(run)], format="trl", model_id="trl-peer", tokenizer=str(run / "tokenizer"),
                                  max_tokens=12, success_threshold=1.0, eval_problems=str(_problems(tmp_path, family[6:7])),
                                  **common), on_note=print)
    dump = verl_rollout_dump(tiny_model_dir, family[7:11], tmp_path / "rollout_data")
    verl = run_import(ImportConfig(files=[str(dump)], format="verl", model_id="verl-peer", tokenizer=str(tiny_model_dir),
                                   max_tokens=16, success_threshold=1.0, extract="gsm8k", **common), on_note=print)
    rows = [OpenR1Row(p.problem, p.answer, [f"\\boxed{{{p.answer}}}", "\\boxed{0}", f"so \\boxed{{{p.answer}}}"],
                      [True, False, True], ["stop", "stop", "stop"]) for p in family[11:]]
    export = parquet_export(openr1_dataset(rows), tmp_path / "OpenR1-Math-220k")
    traces = run_import(ImportConfig(files=[str(export)], model_id="openr1", tokenizer=str(tiny_model_dir),
                                     completion_column="generations", reward_column="correctness_math_verify",
                                     finish_column="finish_reasons", **common), on_note=print)
    imported = {"trl-peer": trl, "verl-peer": verl, "openr1": traces}
    assert all(s.groups and not s.bad_rows for s in imported.values()), {k: s.summary(0.05) for k, s in imported.items()}
    assert verl.scored_by == {"given:score>=1": 16} and verl.disagreements == 0
    assert trl.scored_by and set(trl.scored_by) == {"given:accuracy>=1"} and trl.eval_rows > 0

    with StoreServer(root) as server:
        run_dir = train(make_config(toy_world, tmp_path / "run", server.url, steps=4,
                                    **{"model.path": str(toy_world.peer_dir)}))
    metrics = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    grafted = {g["model_id"] for m in metrics for g in m["grafted_groups"]}
    print([(m["step"], sorted(g["model_id"] for g in m["grafted_groups"]), m["peer_rollouts_without_mu"])
           for m in metrics])
    assert grafted == set(imported), f"grafted over the run: {grafted}"
    assert all(m["peer_rollouts_without_mu"] == m["peer_rollouts_consumed"] for m in metrics)  # none carries mu
    assert all(m["groups_no_peer_tokenizer"] == 0 and m["store_lookup_failures"] == 0 for m in metrics)


def _problems(tmp_path: Path, problems) -> Path:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(p.model_dump()) + "\n" for p in problems))
    return path
