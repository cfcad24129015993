"""graft-import: text-only traces into stored groups without mu, from the files TRL 1.16 and verl 0.9.1 write (made
here by their own code: a GRPOTrainer run with a conversational dataset, num_iterations 2 and an eval set; verl's
`_log_rollout_data` scored by verl's gsm8k reward), imported by the commands docs/bring-your-peers.md prints, from
published trace sets as `datasets` writes them (testbed/trace_sets.py), and from named columns.

The rows must land where a learner looks (the matched problem's prompt id; an import that matches nothing stores
nothing), keep the prompt the trace followed, be scored by the run's own rule (its reward column at a stated
threshold, or math-verify with the run's answer extraction), end as the data says (EOS on finished rows only), carry
the trace's step, and be stored once; a bad row is one line (file, row, reason) and its group is left out whole."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from graft.rollouts.models import load_tokenizer_of, tokenizer_fingerprint
from graft.schemas import NO_LOGPROBS, Problem, RolloutGroup, prompt_id, table_to_groups

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


def refused(proc: subprocess.CompletedProcess, store: Path, *words: str) -> str:
    """The one line an import that stores nothing says (exit 2)."""
    assert proc.returncode == 2, f"graft-import exits {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert not list(store.rglob("*.parquet"))
    return lines[0]


def stored_groups(store: Path, model_id: str) -> list[RolloutGroup]:
    shards = sorted((store / "rollouts" / f"model={model_id}").glob("part-*.parquet"))
    return [g for shard in shards for g in table_to_groups(pq.read_table(shard))]


def write_problems(path: Path, problems: list[dict] = PROBLEMS) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    return path


def check_tokens(group: RolloutGroup, tokenizer) -> None:
    """Each row holds its text's tokens, the tokenizer's EOS after it when it finished (and only then), no mu."""
    for r in group.rollouts:
        assert r.logprobs_mode == NO_LOGPROBS and r.token_logprobs == [] and r.logprob_sum is None
        ended = [tokenizer.eos_token_id] if r.finish_reason == "stop" else []
        assert r.completion_token_ids == tokenizer(r.completion_text, add_special_tokens=False)["input_ids"] + ended
        assert r.tokenizer_id == tokenizer_fingerprint(tokenizer)


# ------------------------------------------------------------------------------------------------ TRL


@pytest.fixture(scope="module")
def trl_run(toy_world, tmp_path_factory):
    """A real GRPOTrainer run of the toy learner (tests/generator/helpers/trl_files.py): 6 steps, num_iterations 2, an eval
    prompt evaluated at step 5 and at the end."""
    pytest.importorskip("trl", reason="the trl extra is not installed: pip install '.[trl]'")
    from trl_files import run_trl

    out = tmp_path_factory.mktemp("trl") / "trl-grpo"
    train, evaluate = toy_world.learner_problems[:6], toy_world.learner_problems[6:7]
    return run_trl(toy_world.learner_dir, train, evaluate, out), train, evaluate


@pytest.mark.slow
def test_trl_completions_of_a_conversational_run_with_repeats_and_eval_rows(trl_run, toy_world, tmp_path):
    """TRL's files hold each generation batch under two step labels and the eval completions among the training
    ones. Imported as the page prints it: each training group once, at the step it first appears, the eval rows left
    out, the assistant's turn as the completion, the rendered chat as the prompt followed, the run's own reward
    (accuracy >= 1) as the reward, finish 'length' where a completion reached max_completion_length (no EOS)."""
    run, train, evaluate = trl_run
    files = sorted((run / "completions").glob("completions_*.parquet"))
    written = {int(f.stem.split("_")[1]): pq.read_table(f).to_pylist() for f in files}
    assert sorted(written) == [1, 2, 3, 4, 5, 6] and {"step", "prompt", "completion", "accuracy", "advantage"} == set(
        written[1][0])  # TRL 1.16's columns
    same = [{k: v for k, v in row.items() if k != "step"} for row in written[1]]
    assert same == [{k: v for k, v in row.items() if k != "step"} for row in written[2]]  # one batch, two labels
    user = {p.problem for p in evaluate}
    assert any(r["prompt"][-1]["content"] in user for r in written[5] + written[6])  # eval rows in the same files
    assert written[1][0]["prompt"][0]["role"] == "system" and written[1][0]["completion"][0]["role"] == "assistant"

    problems = write_problems(tmp_path / "p.jsonl", [p.model_dump() for p in toy_world.learner_problems])
    tokenizer = load_tokenizer_of(run / "tokenizer")
    # with the options of the first graft-import (no eval set named: the eval groups are stored, under their steps):
    # each group once, at its own step, ended as the data says
    plain = tmp_path / "store-plain"
    summary_of(graft_import("--format", "trl", "--file", str(run), "--problems", str(problems), "--model-id", "trl-peer",
                            "--tokenizer", str(run / "tokenizer"), "--store", str(plain), "--set", "max_tokens=12",
                            cwd=tmp_path))
    stored = stored_groups(plain, "trl-peer")
    contents = [tuple(r.completion_text for r in g.rollouts) for g in stored]
    assert len(set(contents)) == len(contents) == 7  # 5 training groups, 2 eval groups (one twice in the files)
    assert {g.policy_step for g in stored} == {1, 3, 5, 6}
    for group in stored:
        check_tokens(group, tokenizer)

    store = tmp_path / "store"
    evals = write_problems(tmp_path / "eval.jsonl", [p.model_dump() for p in evaluate])
    paths = {"runs/trl-grpo": str(run), "--problems gsm8k": f"--problems {problems}",
             "models/peer": str(run / "tokenizer"), "stores/local": str(store), "max_tokens=256": "max_tokens=12",
             "eval_problems=gsm8k_eval.jsonl": f"eval_problems={evals}"}
    proc = page_command("trl", paths, cwd=tmp_path)
    summary = summary_of(proc)
    first_step: dict[tuple, int] = {}
    for step in sorted(written):
        for row in written[step]:
            if row["prompt"][-1]["content"] not in user:
                first_step.setdefault((row["prompt"][-1]["content"],), step)
    eval_rows = sum(r["prompt"][-1]["content"] in user for rows in written.values() for r in rows)
    groups = stored_groups(store, "trl-peer")
    assert (summary["groups"], summary["eval_rows"], summary["bad_rows"]) == (len(groups), eval_rows, 0)
    assert summary["repeated_groups"] == 4 and len(groups) == 5  # batches 1 and 2 twice; batch 3's first group lost
    assert summary["scored_by"] == {"given:accuracy>=1": 20} and summary["disagreement"]["differ"] == 0
    train_rows = sum(len(rows) for rows in written.values()) - eval_rows
    assert summary["disagreement"]["compared"] == 20 and f"{train_rows} of {train_rows} rows' prompts match" in proc.stderr
    by_text = {p.problem: p for p in toy_world.learner_problems}
    for group in groups:
        problem = next(p for p in train if p.prompt_id == group.prompt_id)
        step = group.policy_step
        rows = [w for w in written[step] if w["prompt"][-1]["content"] == problem.problem]
        assert step == first_step[(problem.problem,)]
        assert [r.completion_text for r in group.rollouts] == [w["completion"][-1]["content"] for w in rows]
        assert [r.reward for r in group.rollouts] == [w["accuracy"] for w in rows]
        assert {r.generator_id for r in group.rollouts} == {"graft-import:given:accuracy>=1"}
        assert {r.prompt_text for r in group.rollouts} == {problem.problem}  # the user-turns template's rendering
        text_tokens = [len(tokenizer(r.completion_text, add_special_tokens=False)["input_ids"]) for r in group.rollouts]
        assert [r.finish_reason for r in group.rollouts] == ["length" if n == 12 else "stop" for n in text_tokens]
        assert group.rollouts[0].dataset == "p" and problem.problem in by_text
        check_tokens(group, tokenizer)
    assert {g.policy_step for g in groups} == {1, 3, 5}
    again = summary_of(page_command("trl", paths, cwd=tmp_path))
    assert (again["groups"], again["skipped_already_stored"]) == (0, 5)


# ------------------------------------------------------------------------------------------------ verl


VERL_GROUPS = [
    {"problem": "39+47=", "gold": "86", "completions": ["so #### 86", "#### 85", "39+47 #### 86", "no"]},
    {"problem": "48+34=", "gold": "82", "completions": ["#### 82", "#### 1,082", "the sum is 82 and so on and on and on",
                                                       "#### 82"], "cut": [False, False, True, False]},
]


def verl_dump(tokenizer_dir: Path, out: Path, groups: list[dict], step: int = 3, length: int = 16) -> list[list[float]]:
    """verl's own dump of `groups` (tests/generator/verl_dump.py in .venv-verl); returns the scores verl gave."""
    if not VERL_PYTHON.exists():
        if os.environ.get("GRAFT_REQUIRE_VERL"):
            pytest.fail(f"{VERL_PYTHON} is absent and GRAFT_REQUIRE_VERL is set: make install-verl")
        pytest.skip(f"{VERL_PYTHON} is absent: make install-verl builds verl's environment")
    spec = out.parent / f"{out.name}.json"
    spec.write_text(json.dumps({"tokenizer": str(tokenizer_dir), "out": str(out), "step": step, "groups": groups,
                                "data_source": "openai/gsm8k", "response_length": length}))
    proc = subprocess.run([str(VERL_PYTHON), str(ROOT / "tests" / "generator" / "helpers" / "verl_dump.py"), str(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_verl_rollout_dump_scored_by_verls_gsm8k_reward(tiny_model_dir, tmp_path):
    """verl's dump of a step (rows reordered by its balancing, the chat-templated prompt as `input`, one response cut
    at response_length), scored by verl's gsm8k reward (`#### N`): imported as the page prints it, the groups take
    the matched problems' ids, verl's scores (success at >= 1; math-verify with the gsm8k extraction agrees on every
    row), finish 'length' and no EOS on the cut response, the dumped prompt, and the step."""
    dump = tmp_path / "rollout_data"
    scores = verl_dump(tiny_model_dir, dump, VERL_GROUPS)
    assert scores == [[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]]  # verl's gsm8k reward, strict: '#### N'
    written = [orjson.loads(line) for line in (dump / "3.jsonl").read_bytes().splitlines()]
    assert {"input", "output", "gts", "score", "step"} <= set(written[0]) and written[0]["input"] != "39+47="
    store = tmp_path / "store"
    paths = {"runs/verl-grpo/rollout_data": str(dump), "--problems gsm8k": f"--problems {write_problems(tmp_path / 'p.jsonl')}",
             "models/peer": str(tiny_model_dir), "stores/local": str(store), "max_tokens=512": "max_tokens=16"}
    summary = summary_of(page_command("verl", paths, cwd=tmp_path))
    assert (summary["groups"], summary["rollouts"], summary["success_rate"]) == (2, 8, 4 / 8)
    assert summary["scored_by"] == {"given:score>=1": 8} and summary["disagreement"]["differ"] == 0
    assert summary["finish"] == {"stop": 7, "length": 1} and summary["finish_from"] == {"max_tokens": 8}
    groups = {g.prompt_id: g for g in stored_groups(store, "verl-peer")}
    tokenizer = load_tokenizer_of(tiny_model_dir)
    for spec, given in zip(VERL_GROUPS, scores, strict=True):
        group = groups[prompt_id(spec["problem"])]  # the problem's id, not the templated input's
        rows = [w for w in written if spec["problem"] in w["input"]]
        assert [r.completion_text for r in group.rollouts] == [w["output"] for w in rows]  # in the dump's order
        assert [r.reward for r in group.rollouts] == [w["score"] for w in rows]
        assert sorted(r.reward for r in group.rollouts) == sorted(given)
        assert {r.prompt_text for r in group.rollouts} == {rows[0]["input"]} and group.policy_step == 3
        assert {r.generator_id for r in group.rollouts} == {"graft-import:given:score>=1"}
        check_tokens(group, tokenizer)
    cut = next(r for g in groups.values() for r in g.rollouts if r.completion_text.startswith("the sum"))
    assert cut.finish_reason == "length" and cut.completion_token_ids[-1] != tokenizer.eos_token_id

    # graft's boxed-only scorer is not the run's rule: forced, it disagrees with verl's rewards, and says so
    elsewhere = tmp_path / "store-boxed"
    proc = graft_import("--format", "verl", "--file", str(dump), "--problems", str(tmp_path / "p.jsonl"), "--model-id",
                        "verl-peer", "--tokenizer", str(tiny_model_dir), "--store", str(elsewhere), "--set",
                        "max_tokens=16", "--set", "reward=gold", "--set", "success_threshold=1", cwd=tmp_path)
    boxed = summary_of(proc)
    assert boxed["scored_by"] == {"math-verify:boxed": 8} and boxed["success_rate"] == 0.0
    assert boxed["disagreement"] == {"compared": 8, "differ": 4, "share": 0.5, "max_share": 0.05}
    assert "note: the run's own rewards and math-verify (boxed) disagree on 4 of 8 rows (50.0%" in proc.stderr


@pytest.mark.slow
def test_a_verl_dump_with_a_lost_row_or_without_problems(tiny_model_dir, tmp_path):
    """A line of verl's dump that is not JSON: its group (one row short of the step's group size) is left out in one
    line, the other stored. Without --problems the import is refused in one line: verl's prompts hold the chat
    template, so no learner's lookup would find the groups."""
    dump = tmp_path / "rollout_data"
    verl_dump(tiny_model_dir, dump, VERL_GROUPS)
    lines = (dump / "3.jsonl").read_text().splitlines()
    lost = next(i for i, line in enumerate(lines) if "39+47=" in line)
    lines[lost] = lines[lost][: len(lines[lost]) // 2]  # a write cut short
    (dump / "3.jsonl").write_text("\n".join(lines) + "\n")
    problems = write_problems(tmp_path / "p.jsonl")
    store = tmp_path / "store"
    common = ["--format", "verl", "--file", str(dump), "--model-id", "verl-peer", "--tokenizer", str(tiny_model_dir),
              "--store", str(store), "--set", "max_tokens=16", "--set", "success_threshold=1"]
    proc = graft_import(*common, "--problems", str(problems), cwd=tmp_path)
    summary = summary_of(proc)
    bad = [line for line in proc.stderr.splitlines() if line.startswith("bad row:")]
    assert (summary["groups"], summary["bad_rows"], summary["groups_left_out"]) == (1, 1, 1)
    assert bad[0] == f"bad row: {dump / '3.jsonl'}: row {lost}: " + bad[0].split(f"row {lost}: ", 1)[1]
    assert "not JSON" in bad[0]
    assert "its group of 3 completions is not imported: 3 completions where this file's other groups have 4" in bad[1]
    assert [g.prompt_id for g in stored_groups(store, "verl-peer")] == [prompt_id("48+34=")]

    elsewhere = tmp_path / "store2"
    refused(graft_import(*common[:8], "--store", str(elsewhere), "--set", "max_tokens=16", cwd=tmp_path), elsewhere,
            "--format verl without --problems", "no learner's lookup")


# ------------------------------------------------------------------------------------------------ trace sets


def test_an_openr1_shaped_set_as_the_hubs_parquet_export_and_save_to_disk(tiny_model_dir, tmp_path):
    """OpenR1-Math-220k's shape (testbed/trace_sets.py, written by `datasets`): a row holds a problem's generations,
    their correctness flags and finish reasons, all lists. Each row is one group, scored by the set's own flags (math-
    verify's disagreement counted: one flag here says right where the generation's boxed answer is wrong), 'length'
    rows stored without EOS; the same rows from a save_to_disk folder store the same groups."""
    from testbed.trace_sets import OpenR1Row, openr1_dataset, parquet_export

    rows = [
        OpenR1Row("What is $39+47$?", "86", ["39+47: \\boxed{86}", "I think \\boxed{85}", "Carry the one, so 86 and"],
                  [True, False, False], ["stop", "stop", "length"]),
        OpenR1Row("What is $48+34$?", "82", ["\\boxed{82}", "\\boxed{82}"], [True, True], ["stop", "stop"]),
        OpenR1Row("What is $17+25$?", "42", ["\\boxed{42}", "\\boxed{24}", "\\boxed{43}", "\\boxed{42}"],
                  [True, False, True, True], ["stop"] * 4),  # the third flag disagrees with its boxed answer
    ]
    dataset = openr1_dataset(rows)
    export = parquet_export(dataset, tmp_path / "OpenR1-Math-220k", shards=2)
    dataset.save_to_disk(str(tmp_path / "openr1-saved"))
    columns = ["--set", "completion_column=generations", "--set", "reward_column=correctness_math_verify",
               "--set", "finish_column=finish_reasons"]
    results = {}
    for name, source in (("export", export), ("saved", tmp_path / "openr1-saved")):
        store = tmp_path / f"store-{name}"
        summary = summary_of(graft_import("--file", str(source), "--model-id", "r1", "--tokenizer", str(tiny_model_dir),
                                          "--store", str(store), *columns, cwd=tmp_path))
        assert (summary["groups"], summary["rollouts"], summary["bad_rows"]) == (3, 9, 0)
        assert summary["scored_by"] == {"given:correctness_math_verify": 9}
        assert summary["disagreement"] == {"compared": 9, "differ": 1, "share": 1 / 9, "max_share": 0.05}
        assert summary["finish"] == {"stop": 8, "length": 1} and summary["finish_from"] == {"column": 9}
        results[name] = {g.prompt_id: g for g in stored_groups(store, "r1")}
    assert {k: [r.completion_text for r in g.rollouts] for k, g in results["export"].items()} == \
        {k: [r.completion_text for r in g.rollouts] for k, g in results["saved"].items()}
    tokenizer = load_tokenizer_of(tiny_model_dir)
    for row in rows:
        group = results["export"][prompt_id(row.problem)]
        assert [r.reward for r in group.rollouts] == [float(c) for c in row.correct]
        assert [r.finish_reason for r in group.rollouts] == row.finish_reasons
        assert {r.dataset for r in group.rollouts} == {"imported"} and group.rollouts[0].prompt_text is None
        check_tokens(group, tokenizer)


def test_openthoughts_chats_answer_alone_and_deepmath_solution_columns_form_one_group(tiny_model_dir, tmp_path):
    """An OpenThoughts-114k `save_to_disk` folder: a row's `conversations` (ShareGPT's from/value) gives its user turn
    as the prompt, matched to the learner's problems, and only the assistant's turn as the completion. DeepMath-103K's
    three solution columns (a Hub Parquet export) are one group per row, scored by math-verify against final_answer."""
    from testbed.trace_sets import deepmath_dataset, openthoughts_dataset, parquet_export

    chats = tmp_path / "OpenThoughts-114k"
    openthoughts_dataset([("39+47=", "<|begin_of_thought|>add<|end_of_thought|> \\boxed{86}"),
                          ("48+34=", "\\boxed{80}"), ("48+34=", "\\boxed{82}")]).save_to_disk(str(chats))
    store = tmp_path / "store"
    summary = summary_of(graft_import(
        "--file", str(chats), "--problems", str(write_problems(tmp_path / "p.jsonl")), "--model-id", "thoughts",
        "--tokenizer", str(tiny_model_dir), "--store", str(store), "--set", "problem_column=conversations",
        "--set", "completion_column=conversations", "--set", "finish_reason=stop", cwd=tmp_path))
    assert (summary["groups"], summary["rollouts"], summary["prompt_rows_matched"]) == (2, 3, 3)
    groups = {g.prompt_id: g for g in stored_groups(store, "thoughts")}
    assert [r.completion_text for r in groups[prompt_id("48+34=")].rollouts] == ["\\boxed{80}", "\\boxed{82}"]
    assert [r.reward for r in groups[prompt_id("48+34=")].rollouts] == [0.0, 1.0]
    assert groups[prompt_id("39+47=")].rollouts[0].completion_text.startswith("<|begin_of_thought|>")

    deepmath = parquet_export(deepmath_dataset([
        ("Compute $39+47$.", "86", ["\\boxed{86}", "\\boxed{87}", "It is \\boxed{86}."]),
        ("Compute $48+34$.", "82", ["\\boxed{82}", "\\boxed{82}", "\\boxed{82}"]),
    ]), tmp_path / "DeepMath-103K")
    summary = summary_of(graft_import(
        "--file", str(deepmath), "--model-id", "deepmath", "--tokenizer", str(tiny_model_dir), "--store", str(store),
        "--set", "problem_column=question", "--set", "gold_column=final_answer", "--set", "finish_reason=stop",
        "--set", "completion_column=[r1_solution_1, r1_solution_2, r1_solution_3]", cwd=tmp_path))
    assert (summary["groups"], summary["rollouts"], summary["scored_by"]) == (2, 6, {"math-verify:boxed": 6})
    groups = {g.prompt_id: g for g in stored_groups(store, "deepmath")}
    assert [r.reward for r in groups[prompt_id("Compute $39+47$.")].rollouts] == [1.0, 0.0, 1.0]
    assert [r.completion_text for r in groups[prompt_id("Compute $48+34$.")].rollouts] == ["\\boxed{82}"] * 3


# ------------------------------------------------------------------------------------------------ named columns


def test_named_columns_bad_rows_given_rewards_and_a_missing_column(tiny_model_dir, tmp_path):
    """JSONL with a completions list per row (a whole group), and Parquet rows grouped per problem with the run's own
    rewards at a stated threshold; each bad row is one stderr line naming file, row and reason, its group left out
    whole (a line that is not JSON takes the group of the rows around it), the rest stored and counted."""
    import pyarrow as pa

    traces = tmp_path / "traces"
    traces.mkdir()
    lines = [
        json.dumps({"question": "39+47=", "outputs": ["\\boxed{86}", "\\boxed{87}", "\\boxed{86}"], "solution": "86",
                    "score": None}),
        json.dumps({"question": "48+34=", "outputs": None, "solution": "82", "score": None}),  # row 1: no completion
        json.dumps({"question": "17+25=", "outputs": ["\\boxed{42}", "\\boxed{4}"], "solution": "#### 42", "score": None}),
        json.dumps({"question": "5+5=", "outputs": "\\boxed{10}", "solution": "10", "score": None}),
        "{not json",  # row 4: its neighbours' group (5+5=) is left out with it
        json.dumps({"question": "5+5=", "outputs": "\\boxed{11}", "solution": "10", "score": None}),
    ]
    (traces / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.Table.from_pylist([
        {"question": "1+2=", "outputs": "\\boxed{3}", "solution": None, "score": 1.5},  # a format bonus on top
        {"question": "1+2=", "outputs": "\\boxed{4}", "solution": None, "score": 0.5},  # the format bonus alone
        {"question": "2+2=", "outputs": "\\boxed{4}", "solution": None, "score": 1.5},
        {"question": "2+2=", "outputs": "\\boxed{5}", "solution": None, "score": float("nan")},  # row 3: no number
    ]), traces / "b.parquet")
    store = tmp_path / "store"
    command = ["--file", str(traces), "--model-id", "r1-traces", "--tokenizer", str(tiny_model_dir), "--store", str(store),
               "--set", "problem_column=question", "--set", "completion_column=outputs", "--set", "gold_column=solution",
               "--set", "reward_column=score", "--set", "success_threshold=1", "--set", "finish_reason=stop"]
    proc = graft_import(*command, cwd=tmp_path)
    summary = summary_of(proc)
    bad = [line for line in proc.stderr.splitlines() if line.startswith("bad row:")]
    assert summary["bad_rows"] == 3 and summary["groups_left_out"] == 2, proc.stderr
    assert any(f"{traces / 'a.jsonl'}: row 1: 'outputs' holds None" in line for line in bad)
    assert any(f"{traces / 'a.jsonl'}: row 4: not JSON" in line for line in bad)
    assert any(f"{traces / 'a.jsonl'}: rows 3-5: its group of 2 completions is not imported" in line for line in bad)
    assert any(f"{traces / 'b.parquet'}: row 3: reward nan" in line for line in bad)
    assert any(f"{traces / 'b.parquet'}: row 2: its group of 1 completions is not imported" in line for line in bad)
    assert summary["scored_by"] == {"math-verify:boxed": 5, "given:score>=1": 2}
    groups = {g.prompt_id: g for g in stored_groups(store, "r1-traces")}
    assert set(groups) == {prompt_id(t) for t in ("39+47=", "17+25=", "1+2=")}
    assert [r.reward for r in groups[prompt_id("39+47=")].rollouts] == [1.0, 0.0, 1.0]
    assert [r.reward for r in groups[prompt_id("17+25=")].rollouts] == [1.0, 0.0]  # GSM8K's '#### 42' read as 42
    given = groups[prompt_id("1+2=")]  # the format bonus alone (0.5) is no success at the run's threshold
    assert [r.reward for r in given.rollouts] == [1.0, 0.0]
    assert {r.generator_id for r in given.rollouts} == {"graft-import:given:score>=1"}
    assert all(r.dataset == "imported" for g in groups.values() for r in g.rollouts)
    assert summary_of(graft_import(*command, cwd=tmp_path))["skipped_already_stored"] == 3

    elsewhere = tmp_path / "store2"
    missing = graft_import("--file", str(traces / "a.jsonl"), "--model-id", "x", "--tokenizer", str(tiny_model_dir),
                           "--store", str(elsewhere), "--set", "completion_column=outputs", "--set",
                           "finish_reason=stop", cwd=tmp_path)
    refused(missing, elsewhere, f"{traces / 'a.jsonl'} has no column 'problem'")


def test_a_lost_line_a_cut_completion_and_a_format_bonus_are_not_stored_as_if_whole(tiny_model_dir, tmp_path):
    """With the options the first graft-import had: a group whose line is not JSON is left out, never stored one row
    short; a completion reaching max_tokens was cut (finish 'length', no EOS; the others end with it); a run's reward of
    0.5 (a format bonus) is no success without a stated threshold; no row stores a placeholder logprob_sum."""
    traces = tmp_path / "t.jsonl"
    cut = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"
    lines = [json.dumps({"problem": "39+47=", "completion": c, "answer": "86"}) for c in ("\\boxed{86}", cut)]
    lines += [json.dumps({"problem": "48+34=", "completion": "\\boxed{82}", "answer": "82"}), "{\"problem\": \"48+34=\", "]
    lines += [json.dumps({"problem": "48+34=", "completion": "\\boxed{81}", "answer": "82"})]
    traces.write_text("\n".join(lines) + "\n")
    tokenizer = load_tokenizer_of(tiny_model_dir)
    budget = len(tokenizer(cut, add_special_tokens=False)["input_ids"])
    store = tmp_path / "store"
    proc = graft_import("--file", str(traces), "--model-id", "x", "--tokenizer", str(tiny_model_dir), "--store",
                        str(store), "--set", f"max_tokens={budget}", cwd=tmp_path)
    summary = summary_of(proc)
    assert (summary["groups"], summary["bad_rows"], summary["groups_left_out"]) == (1, 1, 1), proc.stderr
    [group] = stored_groups(store, "x")
    assert group.prompt_id == prompt_id("39+47=")
    assert [r.finish_reason for r in group.rollouts] == ["stop", "length"]
    check_tokens(group, tokenizer)

    # stated, the run's group size holds a group whose other rows are lost without a trace (none left to say so)
    with traces.open("a") as f:
        f.write(json.dumps({"problem": "17+25=", "completion": "\\boxed{42}", "answer": "42"}) + "\n")
    sized = tmp_path / "store-sized"
    proc = graft_import("--file", str(traces), "--model-id", "x", "--tokenizer", str(tiny_model_dir), "--store",
                        str(sized), "--set", f"max_tokens={budget}", "--set", "group_size=2", cwd=tmp_path)
    assert (summary_of(proc)["groups"], summary_of(proc)["groups_left_out"]) == (1, 2)
    assert "rows 6: " not in proc.stderr and "1 completions where the run's groups (group_size) have 2" in proc.stderr

    bonus = tmp_path / "bonus.jsonl"
    bonus.write_text("".join(json.dumps({"problem": "1+2=", "completion": c, "reward": r}) + "\n"
                             for c, r in (("\\boxed{4}", 0.5), ("\\boxed{3}", 1.0))))
    proc = graft_import("--file", str(bonus), "--model-id", "y", "--tokenizer", str(tiny_model_dir), "--store",
                        str(store), "--set", "reward=given", "--set", "finish_reason=stop", cwd=tmp_path)
    assert summary_of(proc)["groups"] == 0 and not stored_groups(store, "y")
    assert "reward 0.5 is a number: state the run's success rule with --set success_threshold=X" in proc.stderr


def test_imports_that_would_store_what_no_learner_finds_or_cannot_end_are_refused(tiny_model_dir, tmp_path):
    """Prompts that match no problem of --problems, a TRL run without --problems, and completions whose ends nobody
    states: each refused in one line, nothing stored. Where some prompts match, the import says how many first."""
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"problem": "What is 2+2?", "completion": ["\\boxed{4}", "\\boxed{5}"]}) + "\n")
    problems = write_problems(tmp_path / "p.jsonl")
    store = tmp_path / "store"
    base = ["--file", str(traces), "--model-id", "x", "--tokenizer", str(tiny_model_dir), "--store", str(store)]
    refused(graft_import(*base, "--problems", str(problems), "--set", "finish_reason=stop", cwd=tmp_path), store,
            "none of the 1 rows' prompts", "matches a problem of", "nothing stored")
    refused(graft_import(*base, "--format", "trl", "--set", "max_tokens=8", cwd=tmp_path), store,
            "--format trl without --problems")
    refused(graft_import(*base, "--problems", str(problems), cwd=tmp_path), store, "how the completions ended",
            "max_tokens", "finish_column", "finish_reason=stop")
    with traces.open("a") as f:
        f.write(json.dumps({"problem": "Say 39+47= please", "completion": ["\\boxed{86}", "\\boxed{5}"]}) + "\n")
    proc = graft_import(*base, "--problems", str(problems), "--set", "finish_reason=stop", cwd=tmp_path)
    summary = summary_of(proc)
    assert "note: 1 of 2 rows' prompts match a problem of" in proc.stderr and "the other 1 are left out" in proc.stderr
    assert (summary["groups"], summary["groups_left_out"]) == (1, 1)
    assert [g.prompt_id for g in stored_groups(store, "x")] == [prompt_id("39+47=")]


def test_a_conversation_completion_is_its_assistant_turns_only(tiny_model_dir, tmp_path):
    """A `messages` column holding the whole chat (system, user, assistant) as the completion: the stored completion is
    the assistant's turn, never the prompt's turns; the prompt column's conversation gives the problem."""
    traces = tmp_path / "chats.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "39+47="},
            {"role": "assistant", "content": "\\boxed{86}"}]
    wrong = [*chat[:2], {"role": "assistant", "content": "\\boxed{85}"}]
    traces.write_text("".join(json.dumps({"messages": m, "answer": "86"}) + "\n" for m in (chat, wrong)))
    store = tmp_path / "store"
    summary_of(graft_import("--file", str(traces), "--model-id", "chat", "--tokenizer", str(tiny_model_dir), "--store",
                            str(store), "--set", "problem_column=messages", "--set", "completion_column=messages",
                            "--set", "finish_reason=stop", cwd=tmp_path))
    [group] = stored_groups(store, "chat")
    assert group.prompt_id == prompt_id("39+47=")
    assert [r.completion_text for r in group.rollouts] == ["\\boxed{86}", "\\boxed{85}"]
    assert [r.reward for r in group.rollouts] == [1.0, 0.0]


def test_the_problem_index_finds_what_the_scan_found(tmp_path):
    """ProblemIndex against the scan it replaced (every problem tested against every prompt): the same problem for
    prompts equal to one, holding one (a template, worked examples holding shorter problems too) or none."""
    import random

    from graft.rollouts.datasets import ProblemIndex

    rng = random.Random(0)
    texts = list(dict.fromkeys(
        [f"{a}+{b}=" for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(300))]
        + [" ".join(rng.choice(["find", "the", "sum", "of", "x", "and", "y", "if"]) for _ in range(rng.randrange(3, 12)))
           for _ in range(300)]))
    problems = [Problem.from_text(t, "1", "d") for t in texts]

    def scan(prompt: str) -> Problem | None:
        text = prompt.strip()
        exact = next((p for p in problems if p.problem.strip() == text), None)
        inside = [p for p in problems if p.problem.strip() in text]
        return exact or max(inside, key=lambda p: len(p.problem.strip()), default=None)

    index = ProblemIndex(problems)
    prompts = [rng.choice(texts) for _ in range(50)]
    prompts += [f"user: {rng.choice(texts)} Think step by step.\nassistant:" for _ in range(100)]
    prompts += [f"Example: {rng.choice(texts)} = 3\nNow: {rng.choice(texts)}" for _ in range(100)]
    prompts += ["nothing here", "12+", "the"]
    for prompt in prompts:
        found, expected = index.match(prompt), scan(prompt)
        assert (found and len(found.problem)) == (expected and len(expected.problem)), prompt
        if expected is not None:
            assert found.problem.strip() in prompt


def test_answer_rules_take_the_answer_each_run_uses():
    from graft.rollouts.scoring import answer_extractor

    text = "Step 1 #### 12\nSo <answer> 1,234 </answer> and \\boxed{7}. Answer: 99\n#### 1,234"
    assert answer_extractor("boxed")(text) == "7"
    assert answer_extractor("gsm8k")(text) == "1234"
    assert answer_extractor("answer_tag")(text) == "1,234"
    assert answer_extractor("regex", r"Answer: (\d+)")(text) == "99"
    assert answer_extractor("gsm8k")("no marker 42") is None
    with pytest.raises(ValueError, match="unknown answer rule"):
        answer_extractor("last_number")


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
                              scoring={"workers": 1}, finish_reason="stop")
        first, second = run_import(config, on_note=lambda _: None), run_import(config, on_note=lambda _: None)
        with StoreClient(server.url) as client:
            stored = [client.prompt_groups(prompt_id(p["problem"]), model="pushed") for p in PROBLEMS]
    assert (first.groups, second.groups, second.skipped_already_stored) == (3, 0, 3)
    assert [len(groups) for groups in stored] == [1, 1, 1]
    assert all([r.reward for r in g[0].rollouts] == [1.0, 0.0] and not g[0].has_behaviour_logprobs for g in stored)
