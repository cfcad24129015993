"""What the demo's commands print about themselves holds: the files their help names exist, and the screenshot
command keeps the committed screenshots unless told to replace them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["demo.run", "studies.mutual"])
def test_the_help_names_only_files_the_repository_has(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    named = set(re.findall(r"(?:studies/)?configs/[\w.-]+\.yaml", proc.stdout))
    assert not [n for n in named if not (REPO_ROOT / n).is_file()], named
    assert named or module == "studies.mutual"


def test_browser_shots_refuses_to_replace_screenshots_without_overwrite(tmp_path):
    from demo.browser_shots import main

    out = tmp_path / "img"
    out.mkdir()
    for name in ("browser-overview.png", "browser-rollout.png"):
        shutil.copy(REPO_ROOT / "docs" / "img" / name, out / name)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as refused:
        main(["--store", str(tmp_path / "store"), "--out", str(out)])
    assert "--overwrite" in str(refused.value) and "browser-overview.png" in str(refused.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
