"""graft-import: text-only traces into stored groups without mu, from the files TRL 1.16 and verl 0.9.1 write (made
here by their own code: a GRPOTrainer run with log_completions, verl's `_log_rollout_data`), imported by the commands
docs/bring-your-peers.md prints, and from named columns.

The rows must hold the traces' texts tokenised by the named tokenizer (EOS appended), math-verify's rewards against
the gold (or the given reward, said in generator_id), logprobs_mode 'none'; a re-import stores nothing; a bad row is
one line (file, row, reason), its group left out, the rest stored; a file without a named column stores nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from graft.rollouts.models import load_tokenizer_of, tokenizer_fingerprint
from graft.schemas import NO_LOGPROBS, RolloutGroup, prompt_id, table_to_groups

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
PAGE = ROOT / "docs" / "bring-your-peers.md"
PROBLEMS = [{"problem": "39+47=", "answer": "86"}, {"problem": "48+34=", "answer": "82"},
            {"problem": "17+25=", "answer": "42"}]


def page_command(fmt: str, substitutions: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """docs/bring-your-peers.md's `graft-import --format FMT` block, run as printed but for its paths (the page's run
    folder, dataset, tokenizer and store replaced by the test's)."""
    code = next(b for b in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S) if f"--format {fmt}" in b)
    for printed, here in substitutions.items():
        assert printed in code, f"{PAGE.name}'s {fmt} block no longer names {printed}"
        code = code.replace(printed, here)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def graft_import(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The console script, as a user runs it."""
    return subprocess.run([str(Path(sys.executable).parent / "graft-import"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"graft-import exits {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stored_groups(store: Path, model_id: str) -> list[RolloutGroup]:
    shards = sorted((store / "rollouts" / f"model={model_id}").glob("part-*.parquet"))
    return [g for shard in shards for g in table_to_groups(pq.read_table(shard))]


def write_problems(path: Path) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def check_tokens(group: RolloutGroup, tokenizer) -> None:
    for r in group.rollouts:
        assert r.logprobs_mode == NO_LOGPROBS and r.token_logprobs == [] and r.logprob_sum == 0.0
        assert r.completion_token_ids == tokenizer(r.completion_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert r.tokenizer_id == tokenizer_fingerprint(tokenizer) and r.finish_reason == "stop"


def text_of(value) -> str:
    """A TRL column's text: the value, or a conversation's content (the last user turn of a prompt, an answer's turns)."""
    if isinstance(value, str):
        return value
    users = [m["content"] for m in value if m["role"] == "user"]
    return users[-1] if users else "".join(m["content"] for m in value)


@pytest.mark.slow
@pytest.mark.parametrize("conversational", [False, True], ids=["text", "conversational"])
def test_trl_completions_parquet_as_trl_writes_it(tiny_model_dir, tmp_path, conversational):
    """A one-step GRPOTrainer run with log_completions=True writes completions/completions_00001.parquet; its 2
    prompts x 4 completions become 2 groups of 4 whose rewards (math-verify against the matched problems' golds) equal
    the run's own reward function's, and a second import stores nothing. Conversational: the prompts are chats (the
    tokenizer's chat template), and TRL writes prompt and completion as lists of messages."""
    pytest.importorskip("trl", reason="the trl extra is not installed: pip install '.[trl]'")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from graft.rollouts.scoring import extract_last_boxed

    def accuracy(completions: list, answer: list[str], **_) -> list[float]:
        return [float(extract_last_boxed(text_of(c)) == a) for c, a in zip(completions, answer)]

    torch.manual_seed(0)
    run = tmp_path / "trl"
    args = GRPOConfig(output_dir=str(run), per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
                      max_steps=1, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", log_completions=True,
                      disable_tqdm=True, seed=0)
    GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=accuracy, args=args,
                train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": p["problem"]}] if conversational
                                                  else p["problem"], "answer": p["answer"]} for p in PROBLEMS[:2]]),
                processing_class=AutoTokenizer.from_pretrained(tiny_model_dir)).train()
    written = pq.read_table(run / "completions" / "completions_00001.parquet").to_pylist()
    assert {"step", "prompt", "completion", "accuracy", "advantage"} == set(written[0])  # TRL 1.16's columns
    assert isinstance(written[0]["completion"], list) == conversational

    store = tmp_path / "store"
    paths = {"runs/trl-grpo": str(run), "--problems gsm8k": f"--problems {write_problems(tmp_path / 'p.jsonl')}",
             "models/peer": str(tiny_model_dir), "stores/local": str(store)}
    summary = summary_of(page_command("trl", paths, cwd=tmp_path))
    assert (summary["groups"], summary["rollouts"], summary["bad_rows"], summary["rewards_from_gold"]) == (2, 8, 0, 8)
    groups = stored_groups(store, "trl-peer")
    tokenizer = load_tokenizer_of(tiny_model_dir)
    by_prompt = {p["problem"]: p for p in PROBLEMS}
    for group in groups:
        problem = next(p for p in by_prompt.values() if prompt_id(p["problem"]) == group.prompt_id)
        rows = [w for w in written if text_of(w["prompt"]) == problem["problem"]]
        assert [r.completion_text for r in group.rollouts] == [text_of(w["completion"]) for w in rows]
        assert [r.reward for r in group.rollouts] == [w["accuracy"] for w in rows]
        assert {r.generator_id for r in group.rollouts} == {"graft-import:math-verify"}
        check_tokens(group, tokenizer)
    again = summary_of(page_command("trl", paths, cwd=tmp_path))
    assert (again["groups"], again["skipped_already_stored"]) == (0, 2)
    assert len(stored_groups(store, "trl-peer")) == 2


@pytest.mark.slow
def test_verl_rollout_dump_as_verl_writes_it(tiny_model_dir, tmp_path):
    """verl's `_log_rollout_data` (in .venv-verl) dumps <step>.jsonl with the chat-templated prompt as `input`; its rows
    group per prompt, match the problems inside the template, and math-verify against `gts` agrees with verl's scores."""
    if not VERL_PYTHON.exists():
        if os.environ.get("GRAFT_REQUIRE_VERL"):
            pytest.fail(f"{VERL_PYTHON} is absent and GRAFT_REQUIRE_VERL is set: make install-verl")
        pytest.skip(f"{VERL_PYTHON} is absent: make install-verl builds verl's environment")
    groups_spec = [
        {"problem": "39+47=", "gold": "86", "completions": ["\\boxed{86}", "\\boxed{85}", "so \\boxed{86}", "no"],
         "scores": [1, 0, 1, 0]},
        {"problem": "48+34=", "gold": "82", "completions": ["\\boxed{81}", "\\boxed{80}"], "scores": [0, 0]},
    ]
    dump = tmp_path / "rollout_data"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"tokenizer": str(tiny_model_dir), "out": str(dump), "step": 3, "groups": groups_spec}))
    proc = subprocess.run([str(VERL_PYTHON), str(ROOT / "tests" / "generator" / "helpers" / "verl_dump.py"), str(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = [orjson.loads(line) for line in (dump / "3.jsonl").read_bytes().splitlines()]
    assert {"input", "output", "gts", "score", "step"} <= set(written[0]) and written[0]["input"] != "39+47="

    store = tmp_path / "store"
    summary = summary_of(page_command("verl", {
        "runs/verl-grpo/rollout_data": str(dump), "--problems gsm8k": f"--problems {write_problems(tmp_path / 'p.jsonl')}",
        "models/peer": str(tiny_model_dir), "stores/local": str(store)}, cwd=tmp_path))
    assert (summary["groups"], summary["rollouts"], summary["rewards_from_gold"], summary["success_rate"]) == (2, 6, 6, 2 / 6)
    groups = {g.prompt_id: g for g in stored_groups(store, "verl-peer")}
    tokenizer = load_tokenizer_of(tiny_model_dir)
    for spec_group in groups_spec:
        group = groups[prompt_id(spec_group["problem"])]  # the problem's id, not the templated input's
        assert [r.completion_text for r in group.rollouts] == spec_group["completions"]
        assert [r.reward for r in group.rollouts] == [float(s) for s in spec_group["scores"]]
        assert group.rollouts[0].dataset == "p"
        check_tokens(group, tokenizer)


def test_named_columns_bad_rows_given_rewards_and_a_missing_column(tiny_model_dir, tmp_path):
    """JSONL with a completions list per row (a whole group), and Parquet rows grouped per problem with given rewards;
    each bad row is one stderr line naming file, row and reason, its group left out, the rest stored and counted."""
    traces = tmp_path / "traces"
    traces.mkdir()
    lines = [
        json.dumps({"question": "39+47=", "outputs": ["\\boxed{86}", "\\boxed{87}", "\\boxed{86}"], "solution": "86", "score": None}),
        json.dumps({"question": "48+34=", "outputs": None, "solution": "82", "score": None}),  # row 1: no completion
        "{not json",  # row 2
        json.dumps({"question": "17+25=", "outputs": ["\\boxed{42}", "\\boxed{4}"], "solution": "#### 42", "score": None}),
        json.dumps({"question": "5+5=", "outputs": "\\boxed{10}", "solution": "10", "score": None}),
        json.dumps({"question": "5+5=", "outputs": {"text": "10"}, "solution": "10", "score": None}),  # row 5
    ]
    (traces / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.Table.from_pylist([
        {"question": "1+2=", "outputs": "\\boxed{3}", "solution": None, "score": 1.0},
        {"question": "1+2=", "outputs": "\\boxed{4}", "solution": None, "score": 0.0},
        {"question": "2+2=", "outputs": "\\boxed{4}", "solution": None, "score": 1.0},
        {"question": "2+2=", "outputs": "\\boxed{5}", "solution": None, "score": 3.5},  # row 3: outside [0, 1]
    ]), traces / "b.parquet")
    store = tmp_path / "store"
    command = ["--file", str(traces), "--model-id", "r1-traces", "--tokenizer", str(tiny_model_dir), "--store", str(store),
               "--set", "problem_column=question", "--set", "completion_column=outputs", "--set", "gold_column=solution",
               "--set", "reward_column=score"]
    proc = graft_import(*command, cwd=tmp_path)
    summary = summary_of(proc)
    bad = [line for line in proc.stderr.splitlines() if line.startswith("bad row:")]
    assert len(bad) == 4 and summary["bad_rows"] == 4 and summary["groups_left_out"] == 2
    assert any(f"{traces / 'a.jsonl'}: row 1: 'outputs' is None" in line for line in bad)
    assert any(f"{traces / 'a.jsonl'}: row 5: 'outputs' is {{'text': '10'}}" in line and "other 1 completions" in line
               for line in bad)
    assert any(f"{traces / 'a.jsonl'}: row 2: not JSON" in line for line in bad)
    assert any(f"{traces / 'b.parquet'}: row 3: reward 3.5 is outside [0, 1]" in line and "group of 2" in line for line in bad)
    assert (summary["groups"], summary["rollouts"], summary["rewards_from_gold"], summary["rewards_given"]) == (3, 7, 5, 2)
    groups = {g.prompt_id: g for g in stored_groups(store, "r1-traces")}
    assert set(groups) == {prompt_id(t) for t in ("39+47=", "17+25=", "1+2=")}
    assert [r.reward for r in groups[prompt_id("39+47=")].rollouts] == [1.0, 0.0, 1.0]
    assert [r.reward for r in groups[prompt_id("17+25=")].rollouts] == [1.0, 0.0]  # GSM8K's '#### 42' read as 42
    given = groups[prompt_id("1+2=")]
    assert [r.reward for r in given.rollouts] == [1.0, 0.0] and {r.generator_id for r in given.rollouts} == {"graft-import:given-reward"}
    assert all(r.dataset == "imported" for g in groups.values() for r in g.rollouts)
    assert summary_of(graft_import(*command, cwd=tmp_path))["skipped_already_stored"] == 3

    elsewhere = tmp_path / "store2"
    missing = graft_import("--file", str(traces / "a.jsonl"), "--model-id", "x", "--tokenizer", str(tiny_model_dir),
                           "--store", str(elsewhere), "--set", "completion_column=outputs", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert f"error: {traces / 'a.jsonl'} has no column 'problem'" in missing.stderr
    assert not list(elsewhere.rglob("*.parquet"))


def test_an_import_pushes_to_a_store_url_and_a_re_import_skips_what_it_holds(tiny_model_dir, tmp_path):
    """--store URL: whole groups pushed through the store's API (graft-generate's sink), the stored ids read back
    through it on the next import."""
    from graft.services.generator.config import ImportConfig
    from graft.services.generator.importing import run_import
    from graft.services.store_api.http.client import StoreClient
    from graft.services.store_api.http.testing import StoreServer

    traces = tmp_path / "t.jsonl"
    traces.write_text("".join(json.dumps({"problem": p["problem"], "completion": [f"\\boxed{{{p['answer']}}}", "\\boxed{0}"],
                                          "answer": p["answer"]}) + "\n" for p in PROBLEMS))
    with StoreServer(tmp_path / "store") as server:
        config = ImportConfig(files=[str(traces)], model_id="pushed", tokenizer=str(tiny_model_dir), store=server.url,
                              score_workers=1)
        first, second = run_import(config), run_import(config)
        with StoreClient(server.url) as client:
            stored = [client.prompt_groups(prompt_id(p["problem"]), model="pushed") for p in PROBLEMS]
    assert (first.groups, second.groups, second.skipped_already_stored) == (3, 0, 3)
    assert [len(groups) for groups in stored] == [1, 1, 1]
    assert all([r.reward for r in g[0].rollouts] == [1.0, 0.0] and not g[0].has_behaviour_logprobs for g in stored)
