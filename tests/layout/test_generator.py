"""The generator side (graft-generate, graft-eval, graft-rescore): a backend is one module and one registration, and no
code asks a backend what it is; the generator loop keeps the run's state in one object, not in loose arguments; the
configs share their prompt, sampler and scoring sections, and no two configuration classes share a name."""

from __future__ import annotations

import ast

from source_tree import GRAFT, first_party_modules

LOOP = GRAFT / "services" / "generator" / "generate.py"
MAX_PARAMETERS = 4  # besides self: a function of the loop that needs more takes the run's state instead
MAX_LINES = 50  # a function of the loop longer than this hides a loop in a loop (issue 59: `_run` was 117)


def _registered() -> dict[str, str]:
    """`module:Class` of each registered backend, by name."""
    from graft.rollouts.backends import BACKENDS

    return {name: entry.backend for name, entry in BACKENDS.items()}


def backend_classes(sources: dict[str, str]) -> set[str]:
    """`module:Class` of each class in `sources` (module -> source) that samples: it defines `generate(self, prompts,
    params)`."""
    found = set()
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source, filename=module)):
            if isinstance(node, ast.ClassDef) and "Protocol" not in map(ast.unparse, node.bases) and any(
                    isinstance(item, ast.FunctionDef) and item.name == "generate"
                    and [a.arg for a in item.args.args] == ["self", "prompts", "params"] for item in node.body):
                found.add(f"{module}:{node.name}")
    return found


def test_every_backend_is_registered_once_and_implements_the_protocol():
    """Adding a backend is one module and one registration (`graft.rollouts.backends.BACKENDS`): every sampling class of
    graft.rollouts is registered there, and each registered class has what the protocol asks, `close` and
    `from_settings` included (issue 59: the loop probed for `close` with getattr)."""
    from graft.rollouts.backends import BACKENDS
    from graft.rollouts.sampling import Backend

    rollouts = {name: path.read_text() for name, path in first_party_modules().items()
                if name.startswith("graft.rollouts.")}
    assert backend_classes(rollouts) == set(_registered().values())
    asked = {name for name in dir(Backend) if not name.startswith("_")} | set(Backend.__annotations__) | {"from_settings"}
    for name, entry in BACKENDS.items():
        backend = entry.load()
        missing = sorted(member for member in asked
                         if not hasattr(backend, member) and member not in _instance_attributes(backend))
        assert missing == [], f"backend {name} ({entry.backend}) lacks {missing}"


def _instance_attributes(cls: type) -> set[str]:
    """The attributes `__init__` sets on self."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(cls.__init__))
    return {target.attr for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for target in (target.elts if isinstance(target, ast.Tuple) else [target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}


def test_the_registration_finder_finds_a_sampling_class():
    source = ("class Engine:\n    def generate(self, prompts, params):\n        return []\n"
              "class Helper:\n    def generate(self, text):\n        return text\n"
              "class Backend(Protocol):\n    def generate(self, prompts, params):\n        ...\n")
    assert backend_classes({"graft.rollouts.engine": source}) == {"graft.rollouts.engine:Engine"}


def probes(source: str, name: str, backend_classes: set[str]) -> list[str]:
    """`name:line` of each question put to a backend about what it is: `isinstance(x, C)` with C a backend class,
    `getattr`/`hasattr` of a named attribute on an object whose name says backend, sampler or rescorer (a wrapper that
    hands every attribute on, `getattr(self.backend, name)`, asks nothing)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        if node.func.id == "isinstance" and set(ast.unparse(node.args[1]).strip("()").replace(" ", "").split(",")) \
                & backend_classes:
            found.append(f"{name}:{node.lineno}")
        elif node.func.id in ("getattr", "hasattr") and isinstance(node.args[1], ast.Constant) and any(
                word in ast.unparse(node.args[0]).lower() for word in ("backend", "sampler", "rescorer")):
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_code_asks_a_backend_what_it_is():
    """Issue 59: graft-generate special-cased the OpenAI backend (`isinstance`), probed for `close` and `on_tokens`
    (getattr, hasattr), graft-train's loop probed its sampler, graft-rescore its rescorer's backend. What a backend
    does is the protocol's (`close`, `server_counts`, `on_tokens`): nothing in graft asks."""
    modules = {name: path.read_text() for name, path in first_party_modules().items() if name.startswith("graft.")}
    classes = {found.rsplit(":", 1)[1] for found in backend_classes(
        {name: source for name, source in modules.items() if name.startswith("graft.rollouts.")})}
    found = [hit for name, source in modules.items() for hit in probes(source, name, classes)]
    assert found == []


def test_the_probe_finder_finds_each_kind():
    source = ("if isinstance(backend, OpenAIBackend):\n    pass\nclose = getattr(backend, 'close', None)\n"
              "if hasattr(hf_sampler, 'on_tokens'):\n    pass\nisinstance(row, dict)\ngetattr(cfg, 'x')\n"
              "getattr(self.backend, name)\n")
    assert probes(source, "m", {"OpenAIBackend"}) == ["m:1", "m:3", "m:4"]


def crowded_functions(source: str, name: str) -> list[str]:
    """`name:function` of each function with more than MAX_PARAMETERS parameters besides self, or longer than
    MAX_LINES lines."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                      if a.arg not in ("self", "cls")]
            if len(params) > MAX_PARAMETERS or node.end_lineno - node.lineno + 1 > MAX_LINES:
                found.append(f"{name}:{node.name}")
    return found


def test_the_generator_loop_keeps_the_run_in_one_object():
    """Issue 59: the run's state went around as loose arguments (`_serve_wanted` took 13, `sample_batch` 11) and
    `_run` was 117 lines of nested loops. Now `GeneratorRun` holds it and no function of the loop is crowded."""
    assert crowded_functions(LOOP.read_text(), "generate") == []


def test_the_crowding_finder_finds_both():
    source = ("def many(a, b, c, d, e):\n    pass\n\nclass R:\n    def few(self, a, b, c, d):\n        pass\n\n"
              "def long():\n" + "    x = 1\n" * MAX_LINES)
    assert crowded_functions(source, "m") == ["m:many", "m:long"]


# The settings the shared sections hold, and the fields of earlier releases' flat configs that held them.
SECTION_FIELDS = {"template", "few_shot", "instruction", "system_prompt", "prompt_template",  # prompt
                  "backend", "openai", "dtype", "hf_batch_size", "vllm_max_model_len",  # sampler
                  "vllm_gpu_memory_utilization", "score_workers", "score_timeout_s"}  # scoring
GENERATOR_SIDE = ("GeneratorConfig", "EvalConfig", "ImportConfig", "RescoreConfig", "DataConfig")


def flat_section_fields(source: str, name: str, classes: tuple[str, ...]) -> list[str]:
    """`name:Class.field` of each field of `classes` (in `source`) that a shared section holds; and
    `name:Class.check_few_shot` where one of them validates a prompt itself."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            found += [f"{name}:{node.name}.{item.target.id}" for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                      and item.target.id in SECTION_FIELDS]
            found += [f"{name}:{node.name}.check_few_shot" for item in ast.walk(node)
                      if isinstance(item, ast.Call) and ast.unparse(item.func) == "check_few_shot"]
    return found


def test_the_generator_side_configs_share_their_sections():
    """Issue 59: four generator-side configs re-declared the prompt, backend and scoring fields (and validated them each
    on their own); the learner's prompt was `data.prompt_template` where the peer's was `template`. Each is a section
    now (`prompt`, `sampler`, `scoring`), declared and validated once, the learner's prompt the same section."""
    found = [hit for module in ("graft.services.generator.config", "graft.trainer.config")
             for hit in flat_section_fields(first_party_modules()[module].read_text(), module, GENERATOR_SIDE)]
    assert found == []


def test_the_section_finder_finds_a_flat_field_and_its_own_check():
    source = ("class EvalConfig(BaseModel):\n    template: str = 'auto'\n    k: int = 1\n\n"
              "    def _check(self):\n        check_few_shot(self.template, 0)\n")
    assert flat_section_fields(source, "m", GENERATOR_SIDE) == ["m:EvalConfig.template", "m:EvalConfig.check_few_shot"]


def shared_config_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each name of a class that a config module (`*.config`, or `*.sections`) defines and another first-party class
    also has: name -> the modules."""
    defined: dict[str, list[str]] = {}
    for module, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source, filename=module)):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(module)
    configs = {name for name, modules in defined.items() if any(m.endswith((".config", ".sections")) for m in modules)}
    return {name: modules for name, modules in defined.items() if name in configs and len(modules) > 1}


def test_no_two_configuration_classes_share_a_name():
    """Issue 59: two `GraftConfig`s (TRL's, and graft-train's graft section) and two `EvalConfig`s (graft-eval's,
    graft-train's eval section). The graft section is `GraftOptions` (as the adapters already imported it), the eval
    section `PeriodicEvalConfig`."""
    sources = {name: path.read_text() for name, path in first_party_modules().items() if name.startswith("graft.")}
    assert shared_config_names(sources) == {}


def test_the_name_finder_finds_a_shared_config_name():
    sources = {"graft.a.config": "class EvalConfig:\n    pass\n", "graft.b.config": "class EvalConfig:\n    pass\n",
               "graft.c.errors": "class BadCursor(ValueError):\n    pass\n", "graft.d.x": "class BadCursor:\n    pass\n"}
    assert shared_config_names(sources) == {"EvalConfig": ["graft.a.config", "graft.b.config"]}

