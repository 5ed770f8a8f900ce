"""Anything unexpected inside a run directory is one line, on a new run and on its --resume:
a directory where popbert writes a file (config.yaml, metrics.jsonl, the exports) and a file
where it keeps a directory (checkpoints/, a checkpoints/step-*/). Before this check a resume
ran on and ended in a traceback at its first checkpoint or metrics line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from checkpoint_helpers import random_task_run

from popbert.cli.main import main
from popbert.config import load_config
from popbert.errors import UsageError
from popbert.io.run_dir import RUN_DIRECTORIES, RUN_FILES, check_layout


def make_run(directory: Path) -> Path:
    cfg = load_config("tiny", ["training.steps=4", "model.num_layers=1", "model.hidden_size=32",
                               "model.num_heads=2", "model.intermediate_size=64",
                               "model.sequence_length=32", "model.max_position_embeddings=64"])
    random_task_run(directory, cfg, "pretraining", seed=3, step=2)
    (directory / "metrics.jsonl").write_text('{"step": 2, "loss": 9.0}\n')
    return directory


def swap_type(entry: Path) -> None:
    """Replace `entry` (or its absence) by the other type: a file by a directory and back."""
    if entry.is_dir():
        shutil.rmtree(entry)
        entry.write_text("not popbert's\n")
    else:
        entry.unlink(missing_ok=True)
        entry.mkdir()
        (entry / "notes.txt").write_text("mine")


@pytest.mark.parametrize("name", sorted(RUN_FILES - {".lock"}))
def test_each_entry_of_the_wrong_type_is_named(tmp_path: Path, name: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if name in RUN_DIRECTORIES:
        (run / name).write_text("a file")
    else:
        (run / name).mkdir()
    with pytest.raises(UsageError, match=rf"--resume {run}: {name} is a "):
        check_layout(run, "--resume")


def test_a_step_that_is_a_file(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    (run / "checkpoints" / "step-000009").write_text("x")
    with pytest.raises(UsageError, match="checkpoints/step-000009 is a file where popbert "
                                         "keeps a directory"):
        check_layout(run)


@pytest.mark.parametrize("entry", ["config.yaml", "metrics.jsonl", "metrics.png",
                                   "checkpoints/step-000002"])
def test_resume_and_new_run_refuse_in_one_line(tmp_path: Path, entry: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "run")
    if entry.startswith("checkpoints/"):  # the newest is damaged: an older one is resumed
        shutil.copytree(run / entry, run / "checkpoints" / "step-000001")
    swap_type(run / entry)
    before = sorted(str(p) for p in run.rglob("*"))
    capsys.readouterr()
    assert main(["pretrain", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{entry} is a " in err[0] and "--resume" in err[0], err
    assert main(["pretrain", "-o", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{entry} is a " in err[0] and "--output-dir" in err[0], err
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing written or removed
