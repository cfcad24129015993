"""The pages that describe the project agree with it, and it cites only them: docs/ARCHITECTURE.md's one layout table
has a row for every top-level folder and every part of the store, names every command, and gives the import order the
code keeps; every citation points into docs/ (a user's clone has nothing else), at a section that is there."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from source_tree import GRAFT, INSTALLED, ROOT, STORE, import_graph, store_parts

ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def _tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [Path(name) for name in listed.split("\0") if name]


def _layout_rows() -> list[list[str]]:
    """docs/ARCHITECTURE.md's layout table: each row's paths (the backticked names of its first column)."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layout of the repository", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [re.findall(r"`([^`]+)`", cell) for cell in rows]


def test_every_top_level_folder_has_a_row_in_the_one_layout_table():
    """One layout table (docs/ARCHITECTURE.md): a row for every folder the repository tracks, and no row naming a path
    that is gone."""
    folders = {f"{path.parts[0]}/" for path in _tracked_files() if len(path.parts) > 1 and not path.parts[0].startswith(".")}
    listed = {path for row in _layout_rows() for path in row}
    assert sorted(f for f in folders if not any(path.startswith(f) for path in listed)) == []  # services/: its parts' rows
    assert sorted(path for path in listed if not (ROOT / path).exists()) == []


def test_architecture_names_every_command_and_every_part_of_the_store():
    """Issue 59: the map named 4 of the 6 commands and called the verl plugin "later". Every console script and entry
    point group of pyproject.toml is named in docs/ARCHITECTURE.md, and every sub-package of the store has its row."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [*project["scripts"], *project.get("entry-points", {})]
    text = ARCHITECTURE.read_text()
    assert [name for name in names if f"`{name}`" not in text] == []
    rows = {path for row in _layout_rows() for path in row}
    store = GRAFT / "services" / "store_api"
    sub_packages = sorted(p.name for p in store.iterdir() if (p / "__init__.py").exists())
    assert [name for name in sub_packages if f"src/graft/services/store_api/{name}/" not in rows] == []


def _import_orders() -> dict[str, list[str]]:
    """docs/ARCHITECTURE.md's import order: "- the installed packages: `a`, `b`, ..." and "- the store's parts
    (`services/store_api/`): `x`, ...", each list's names (a lone word in backticks) in order."""
    text = ARCHITECTURE.read_text()
    orders = {}
    for key, marker in (("installed", "- the installed packages:"), ("store", "- the store's parts")):
        start = text.find(marker)
        if start < 0:
            continue
        item = text[start:].split("\n- ", 1)[0].split("\n\n", 1)[0]
        orders[key] = re.findall(r"`(\w+)`", item)
    return orders


def against_the_order(order: list[str], graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each import of a node named in `order` by one named before it (or by itself), and each node of the
    graph that `order` leaves out."""
    place = {name: i for i, name in enumerate(order)}
    found = [f"{node}: not in the order" for node in sorted(graph) if node not in place]
    found += [f"{node} -> {imported}" for node in order for imported in sorted(graph.get(node, ()))
              if imported in place and place[imported] <= place[node]]
    return found


def _by_name(graph: dict[str, set[str]], name) -> dict[str, set[str]]:
    merged: dict[str, set[str]] = {}
    for node, imports in graph.items():
        if name(node) is not None:
            merged.setdefault(name(node), set()).update(n for n in map(name, imports) if n not in (None, name(node)))
    return merged


def test_the_import_order_architecture_gives_is_the_codes():
    """Issue 59: the map's import order left broker/ out. docs/ARCHITECTURE.md lists the installed packages and the
    store's parts top to bottom; each imports only those below it, and each list names all of them."""
    orders = _import_orders()
    assert set(orders) == {"installed", "store"}, "docs/ARCHITECTURE.md gives no import order (see its layout section)"
    graph = import_graph()
    installed = _by_name(graph, lambda m: m.split(".")[1] if m.startswith("graft.") and len(m.split(".")) > 1 else None)
    assert sorted(orders["installed"]) == sorted(INSTALLED)
    assert against_the_order(orders["installed"], installed) == []
    parts = {node.removeprefix(STORE + "."): {i.removeprefix(STORE + ".") for i in imports}
             for node, imports in store_parts(graph).items()}
    assert against_the_order(orders["store"], parts) == []


def test_the_order_rule_finds_an_import_upwards_and_a_part_left_out():
    graph = {"http": {"local"}, "local": {"http"}, "lake": {"local"}, "new": set()}
    assert against_the_order(["http", "lake", "local"], graph) == ["new: not in the order", "local -> http"]


# The background documents the project was built from, which a user's clone does not have. Their names are built
# here (the rules' file is docs/style.md's name in capitals), so that this file, which must name them to find them,
# cites none of them itself.
SPEC_NAME, RULES_NAME = "GRAFT" + "_SPEC", "style".upper() + ".md"
BACKGROUND = re.compile("|".join([re.escape(SPEC_NAME), r"(?<![\w/])" + re.escape(RULES_NAME), "HOUSE_REVIEW",
                                  "TOY_STUDY", "VERL_NOTES", "SERVED_PEERS_NOTES", r"\.\./shared/"]))
NUMBERS = r"\d+(?:(?:-|, | and )\d+)*"
CITED_SECTION = re.compile(rf"algorithm\.md\s+sections?\s+({NUMBERS})")
CITED_RULE = re.compile(r"style\.md, rules? (\d+)")
ANCHOR = re.compile(r"\]\((?:[./\w-]*/)?(algorithm|style)\.md#([\w-]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _numbers(cited: str) -> set[int]:
    found: set[int] = set()
    for part in re.split(r", | and ", cited):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found


def wrong_citations(name: str, text: str, sections: set[int], rules: set[int], anchors: dict[str, set[str]]) -> list[str]:
    """`name:line what` for each citation in `text` of a background document, of an algorithm.md section or style.md
    rule that is not there, or of an anchor of either page that no heading makes."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [f"{name}:{number} cites {m.group(0)}" for m in BACKGROUND.finditer(line)]
        found += [f"{name}:{number} cites {m.group(0)}: no such section" for m in CITED_SECTION.finditer(line)
                  if not _numbers(m.group(1)) <= sections]
        found += [f"{name}:{number} cites {m.group(0)}: no such rule" for m in CITED_RULE.finditer(line)
                  if int(m.group(1)) not in rules]
        found += [f"{name}:{number} links {m.group(1)}.md#{m.group(2)}: no such heading" for m in ANCHOR.finditer(line)
                  if m.group(2) not in anchors[m.group(1)]]
    return found


def test_the_repository_cites_only_its_own_pages():
    """Issue 59: 75 citations of a spec the clone does not have (`graft-train --help` said "see" it). What the code and
    the pages cite is docs/algorithm.md (sections numbered as the code cites them) and docs/style.md (rules numbered),
    and each citation names a section, rule or anchor that is there."""
    pages = {page: (ROOT / "docs" / f"{page}.md").read_text() for page in ("algorithm", "style")}
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", pages["algorithm"], re.MULTILINE)}
    rules = {int(n) for n in re.findall(r"^(\d+)\. \*\*", pages["style"], re.MULTILINE)}
    anchors = {page: {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)} for page, text in pages.items()}
    assert sections >= set(range(1, 12)) and rules >= set(range(1, 10))
    found = []
    for path in _tracked_files():
        if path == Path(__file__).relative_to(ROOT) or not (ROOT / path).is_file():
            continue
        try:
            text = (ROOT / path).read_text()
        except UnicodeDecodeError:
            continue  # a binary file (a plot, a Parquet file)
        found += wrong_citations(str(path), text, sections, rules, anchors)
    assert found == []


def test_the_citation_rule_finds_each_kind():
    text = (f"see {SPEC_NAME} section 4\n(docs/algorithm.md sections 4-5, 12)\ndocs/style.md, rule 10\n"
            "[a](algorithm.md#4-the-gate) [b](../docs/style.md#the-rules) docs/algorithm.md section 4\n")
    assert wrong_citations("x.py", text, set(range(1, 12)), set(range(1, 10)),
                           {"algorithm": {"4-the-sequence-weight"}, "style": {"the-rules"}}) == [
        f"x.py:1 cites {SPEC_NAME}",
        "x.py:2 cites algorithm.md sections 4-5, 12: no such section",
        "x.py:3 cites style.md, rule 10: no such rule",
        "x.py:4 links algorithm.md#4-the-gate: no such heading",
    ]
