"""`python -m toy.setup_models`: docker-compose's one-shot models service."""

from __future__ import annotations

from pathlib import Path

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
