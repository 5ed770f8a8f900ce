"""A run survives what users do to it: resume in place, divergence, kills during a checkpoint
write, many checkpoints, bad output paths and devices."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from popbert.cli.main import main
from popbert.io.run_dir import checkpoint_dirs

# A tiny run of a few steps, fast on 2 CPU cores.
SMALL = ["--set", "model.num_layers=1", "--set", "model.hidden_size=32",
         "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
         "--set", "model.sequence_length=32", "--set", "model.max_position_embeddings=32",
         "--set", "model.max_predictions_per_seq=5", "--set", "execution.micro_batch_size=8",
         "--set", "training.log_every=1", "--set", "optimizer.warmup_steps=2"]


def pretrain(*args: str) -> int:
    return main(["pretrain", *SMALL, *args])


def steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("popbert: error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.e2e
def test_resume_continues_in_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "a"
    assert pretrain("--output-dir", str(run), "--set", "training.steps=4",
                    "--set", "training.checkpoint_every=2") == 0
    caplog.clear()
    with caplog.at_level("INFO", logger="popbert"):
        assert pretrain("--resume", str(run), "--set", "training.steps=6") == 0
    assert not (tmp_path / "runs").exists()  # no new run directory
    assert [p.name for p in checkpoint_dirs(run)][-1] == "step-000006"
    assert "trained 2 steps (4 → 6)" in caplog.text
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6]


@pytest.mark.e2e
def test_resume_from_an_older_checkpoint_cuts_the_metrics_back(tmp_path: Path) -> None:
    run = tmp_path / "a"
    assert pretrain("--output-dir", str(run), "--set", "training.steps=6",
                    "--set", "training.checkpoint_every=2",
                    "--set", "training.keep_checkpoints=0") == 0
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6]
    older = run / "checkpoints" / "step-000002"
    assert pretrain("--resume", str(older), "--set", "training.steps=6") == 0
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6]  # each step once, not 3..6 twice


@pytest.mark.e2e
def test_keep_checkpoints_keeps_the_newest_and_the_final(tmp_path: Path) -> None:
    run = tmp_path / "a"
    assert pretrain("--output-dir", str(run), "--set", "training.steps=9",
                    "--set", "training.checkpoint_every=2",
                    "--set", "training.keep_checkpoints=2") == 0
    assert [p.name for p in checkpoint_dirs(run)] == ["step-000006", "step-000008",
                                                      "step-000009"]


@pytest.mark.e2e
def test_orphaned_temporary_checkpoints_are_removed_at_start(tmp_path: Path) -> None:
    run = tmp_path / "a"
    assert pretrain("--output-dir", str(run), "--set", "training.steps=2") == 0
    orphan = run / "checkpoints" / ".tmp-step-000004-12345"
    orphan.mkdir()
    (orphan / "weights.safetensors").write_bytes(b"torn")
    assert pretrain("--resume", str(run), "--set", "training.steps=3") == 0
    assert not orphan.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        p.name for p in checkpoint_dirs(run)]


@pytest.mark.e2e
def test_a_run_whose_loss_explodes_stops_with_one_line_and_a_plot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's repro: lr 100 without warmup. The loss stays finite but jumps by 10^4; the
    checkpoint of step 1 holds the weights that made it, so it is not kept as good."""
    run = tmp_path / "a"
    status = pretrain("--output-dir", str(run), "--set", "training.steps=40",
                      "--set", "training.checkpoint_every=1",
                      "--set", "optimizer.lr=100", "--set", "optimizer.warmup_steps=0")
    assert status == 2
    line = error_line(capsys)
    assert "diverged at step 2: the loss" in line and "training.divergence_factor" in line, line
    assert "no checkpoint was written before it" in line, line
    assert checkpoint_dirs(run) == []
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert steps_logged(run) == [1, 2]
    assert not (run / "model.inference.onnx").exists()


@pytest.mark.e2e
def test_a_non_finite_loss_stops_the_run_and_names_the_last_good_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "a"
    # Warmup keeps step 1 sane; step 2's learning rate (~1e29) overflows the weights' squares.
    status = pretrain("--output-dir", str(run), "--set", "training.steps=40",
                      "--set", "training.checkpoint_every=1",
                      "--set", "training.keep_checkpoints=1",
                      "--set", "training.divergence_factor=0",
                      "--set", "optimizer.lr=1e30", "--set", "optimizer.warmup_steps=4")
    assert status == 2
    line = error_line(capsys)
    assert "diverged at step" in line and "not finite" in line, line
    kept = checkpoint_dirs(run)
    assert kept and f"the last good checkpoint is {kept[-1]}" in line, (line, kept)
    weights = safetensors.numpy.load_file(str(kept[-1] / "weights.safetensors"))
    assert all(np.isfinite(w).all() for w in weights.values())
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not math.isfinite(losses[-1])
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    # The run resumes from the good checkpoint (with a sane learning rate).
    assert pretrain("--resume", str(run), "--set", "training.steps=4",
                    "--set", "optimizer.lr=1e-3", "--set", "training.divergence_factor=0") == 0


def test_output_dir_that_is_a_file_is_rejected(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    assert pretrain("--output-dir", str(target)) == 2
    assert "--output-dir" in error_line(capsys)
    assert pretrain("--output-dir", str(target / "run")) == 2
    assert "is a file" in error_line(capsys)
    assert target.read_text() == "x"


def test_output_dir_that_cannot_be_written_is_rejected(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    # /proc refuses new directories even to root (a chmod would not stop root).
    assert pretrain("--output-dir", "/proc/popbert-run", "--set", "training.steps=1") == 2
    line = error_line(capsys)
    assert "--output-dir /proc/popbert-run" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_that_is_not_there_is_rejected(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "a"
    assert pretrain("--output-dir", str(run), "--set", "execution.device=cuda") == 2
    assert "execution.device" in error_line(capsys)
    assert not run.exists()


@pytest.mark.e2e
def test_the_example_is_the_main_job(tmp_path: Path) -> None:
    """examples/pretrain.py, the walk through the API, trains exactly what `popbert pretrain`
    trains: same flags, same outputs, bit-identical weights."""
    import subprocess
    import sys

    args = [*SMALL, "--set", "training.steps=6", "--set", "training.checkpoint_every=3"]
    assert pretrain("--output-dir", str(tmp_path / "cli"), "--set", "training.steps=6",
                    "--set", "training.checkpoint_every=3") == 0
    example = Path(__file__).resolve().parents[2] / "examples" / "pretrain.py"
    subprocess.run([sys.executable, str(example), *args, "--output-dir", str(tmp_path / "ex")],
                   check=True, capture_output=True, timeout=300)
    for name in ("config.yaml", "model.onnx", "model.inference.onnx", "metrics.jsonl",
                 "metrics.png"):
        assert (tmp_path / "ex" / name).is_file(), name
    assert [p.name for p in checkpoint_dirs(tmp_path / "ex")] == ["step-000003", "step-000006"]
    ours = safetensors.numpy.load_file(
        str(tmp_path / "ex" / "checkpoints" / "step-000006" / "weights.safetensors"))
    theirs = safetensors.numpy.load_file(
        str(tmp_path / "cli" / "checkpoints" / "step-000006" / "weights.safetensors"))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
