"""One's own problem files: the columns named, GSM8K's `#### 7` answers read, and a bad file refused in one line."""

from __future__ import annotations

import json

import pytest

from graft.rollouts.datasets import gold_answer, load_problems
from graft.rollouts.prompts import INSTRUCTION, build_prompt


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_raw_gsm8k_file_is_read_with_its_own_column_names(tmp_path):
    raw = write_jsonl(tmp_path / "raw.jsonl", [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A box holds 1,200 pens; 200 are sold. How many are left?", "answer": "1200 - 200 = 1000\n#### 1,000"},
    ])
    problems = load_problems(str(raw), problem_field="question")
    assert [(p.problem[:3], p.answer, p.dataset) for p in problems] == [("Tom", "7", "raw"), ("A b", "1000", "raw")]


@pytest.mark.parametrize("text, gold", [("18", "18"), ("...\n#### 18", "18"), ("#### 1,234.5", "1234.5"),
                                        ("#### -7", "-7"), ("\\frac{1}{2}", "\\frac{1}{2}"), ("x #### 3, 4", "3, 4")])
def test_gold_answers(text, gold):
    assert gold_answer(text) == gold


def test_a_file_without_the_named_columns_is_refused_in_one_line_that_says_what_to_set(tmp_path):
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    with pytest.raises(ValueError) as error:
        load_problems(str(raw))
    message = str(error.value)
    assert "\n" not in message and "'problem'" in message and "question, answer" in message
    assert "--set problem_field=" in message and "data.problem_field" in message
    with pytest.raises(ValueError, match="'solution'"):
        load_problems(str(raw), problem_field="question", answer_field="solution")


def test_the_instruction_and_the_system_prompt_are_the_callers():
    class Chat:  # a chat template that shows its turns
        chat_template = "x"

        @staticmethod
        def apply_chat_template(messages, tokenize, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    assert build_prompt(Chat, "1+1?") == f"user:1+1?\n{INSTRUCTION}"
    assert build_prompt(Chat, "1+1?", instruction="Box it.", system_prompt="Be brief.") == \
        "system:Be brief.|user:1+1?\nBox it."
    assert build_prompt(Chat, "1+1?", instruction="") == "user:1+1?"
    assert build_prompt(None, "1+1?", "plain", instruction="Box it.") == "Question: 1+1?\nBox it.\nAnswer: Let's think step by step."
    with pytest.raises(ValueError, match="system_prompt"):
        build_prompt(None, "1+1?", "plain", system_prompt="Be brief.")  # a setting that would do nothing
    with pytest.raises(ValueError, match="instruction"):
        build_prompt(None, "1+1?", "raw", instruction="Box it.")
