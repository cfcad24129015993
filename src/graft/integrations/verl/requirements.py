"""The project's core requirements as they go into verl's environment (.venv-verl, `make install-verl`), one a line.

The project is installed there without its dependencies (`pip install --no-deps -e .`), and these are resolved
together with verl's. Two of pyproject's requirements cannot hold next to verl 0.9.1:
- transformers: verl pins `>=5.5.3,<5.11`, the project `>=5.16.1` (verl's pin wins; the code GRAFT runs inside verl,
  trainer/{gate,batch,retokenize,peers} and the store client, is tested under it by tests/integrations/inside_verl);
- math-verify's `antlr4_13_2` extra: verl's hydra-core pins antlr4-python3-runtime 4.9.*, and with the extra pip can
  only satisfy both with a hydra-core from 2019 that verl cannot run on. math-verify itself stays (the scorer imports);
  verl computes rewards with its own reward functions, never with graft's scorer.

Usage: `python src/graft/integrations/verl/requirements.py pyproject.toml` (the Makefile's install-verl: a file run
before the project is installed, so it imports nothing of it)."""

from __future__ import annotations

import sys
import tomllib

LEFT_OUT = ("transformers",)
EXTRAS_LEFT_OUT = {"math-verify": "antlr4_13_2"}


def verl_requirements(pyproject: str) -> list[str]:
    """pyproject's dependencies less LEFT_OUT, and without the extras in EXTRAS_LEFT_OUT."""
    with open(pyproject, "rb") as handle:
        requirements = tomllib.load(handle)["project"]["dependencies"]
    out = []
    for requirement in requirements:
        name = requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip()
        if name in LEFT_OUT:
            continue
        if name in EXTRAS_LEFT_OUT:
            requirement = requirement.replace(f"[{EXTRAS_LEFT_OUT[name]}]", "")
        out.append(requirement)
    return out


if __name__ == "__main__":
    print(*verl_requirements(sys.argv[1]), sep="\n")
