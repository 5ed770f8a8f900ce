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


# ---------------------------------------------------------------------------------------------
# A run directory belongs to one run (issue 20): a new run refuses another run's directory
# (--overwrite deletes that run first), and a run's directory is locked while it lives.


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file()}


@pytest.mark.e2e
def test_a_new_run_refuses_a_directory_holding_another_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's repro: a second, different run with `-o ref` exited 0, replaced the config,
    pruned the old checkpoints and appended its steps to the old metrics."""
    ref = tmp_path / "ref"
    assert pretrain("--set", "training.steps=4", "--set", "training.checkpoint_every=2",
                    "--set", "training.keep_checkpoints=0", "-o", str(ref)) == 0
    before = snapshot(ref)
    capsys.readouterr()
    assert pretrain("--set", "training.steps=2", "--set", "execution.micro_batch_size=4",
                    "-o", str(ref)) == 2
    line = error_line(capsys)
    assert line.startswith(f"popbert: error: --output-dir {ref}: holds another run ("), line
    assert f"continue it with --resume {ref}" in line and "--overwrite" in line, line
    assert snapshot(ref) == before  # same files, same bytes
    assert not (ref / ".lock").exists()

    # --overwrite: a clean run of its own (its config, its metrics from step 1, its checkpoints).
    assert pretrain("--set", "training.steps=2", "--set", "execution.micro_batch_size=4",
                    "-o", str(ref), "--overwrite") == 0
    assert steps_logged(ref) == [1, 2]
    assert [p.name for p in checkpoint_dirs(ref)] == ["step-000002"]
    assert "micro_batch_size: 4" in (ref / "config.yaml").read_text()
    assert not (ref / ".lock").exists()  # released after a normal run
    # --resume is unchanged (at the run's own global batch: another would change the sample
    # order, tests/data/test_loader.py); with --overwrite it is refused (it would delete what
    # it resumes).
    assert pretrain("--resume", str(ref), "--set", "training.steps=3",
                    "--set", "execution.micro_batch_size=4") == 0
    assert steps_logged(ref) == [1, 2, 3]
    assert pretrain("--resume", str(ref), "--set", "training.steps=4", "--overwrite") == 2
    assert "--overwrite would delete the run --resume continues" in error_line(capsys)


def test_overwrite_never_clears_a_directory_with_other_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mixed = tmp_path / "mixed"
    (mixed / "checkpoints").mkdir(parents=True)
    (mixed / "config.yaml").write_text("training: {steps: 2}\n")
    (mixed / "notes.txt").write_text("my notes")
    before = snapshot(mixed)
    assert pretrain("--set", "training.steps=1", "-o", str(mixed), "--overwrite") == 2
    line = error_line(capsys)
    assert "files popbert did not write (notes.txt)" in line, line
    assert snapshot(mixed) == before and (mixed / "checkpoints").is_dir()

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "shard.h5").write_text("data")
    assert pretrain("--set", "training.steps=1", "-o", str(theirs)) == 2
    assert "is not empty (shard.h5) and holds no popbert run" in error_line(capsys)
    assert [p.name for p in theirs.iterdir()] == ["shard.h5"]


@pytest.mark.e2e
def test_a_fine_tuning_run_refuses_another_runs_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fine-tuning outputs follow the same rule (checked before the checkpoint or data are
    read); examples/pretrain.py takes --overwrite like `popbert pretrain`."""
    import subprocess
    import sys

    sentiment = Path(__file__).resolve().parents[1] / "fixtures" / "classification" / \
        "sentiment.tsv"
    out = tmp_path / "sst"
    out.mkdir()
    for name, text in (("config.yaml", "finetune: {task: classification}\n"),
                       ("metrics.jsonl", '{"step": 1, "loss": 0.7}\n'),
                       ("eval_results.json", '{"accuracy": 0.5}')):
        (out / name).write_text(text)
    before = snapshot(out)
    squad = sentiment.parents[1] / "squad" / "squad-v1.1-sample.json"
    pre = tmp_path / "pre"  # a checkpoint as far as the flags' checks look; never read
    pre.mkdir()
    (pre / "state.json").write_text("{}")
    for task, train in (("classify", sentiment), ("squad", squad)):
        assert main(["finetune", task, "--checkpoint", str(pre), "--train", str(train),
                     "-o", str(out)]) == 2
        line = error_line(capsys)
        assert f"--output-dir {out}: holds another run (" in line and "--overwrite" in line
    assert snapshot(out) == before

    example = Path(__file__).resolve().parents[2] / "examples" / "pretrain.py"
    proc = subprocess.run([sys.executable, str(example), "-o", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"popbert: error: --output-dir {out}: holds another run ("), proc.stderr
    assert "--overwrite" in proc.stderr and snapshot(out) == before


@pytest.mark.e2e
def test_a_locked_run_directory_refuses_a_second_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """While a run holds its directory, a `--resume` or a new run there stops with one line
    naming the holder (here this very process: flock locks belong to open files, not
    processes); the lock goes after a normal run, and after a run that raised."""
    import os
    import socket

    import popbert
    from popbert.locking import lock_directory

    run = tmp_path / "run"
    assert pretrain("--set", "training.steps=2", "-o", str(run)) == 0
    before = snapshot(run)
    with lock_directory(run):
        assert pretrain("--resume", str(run), "--set", "training.steps=3") == 2
        line = error_line(capsys)
        assert line.startswith(f"popbert: error: {run}: in use by another popbert process"), line
        assert f"held by pid {os.getpid()} on host {socket.gethostname()} since" in line, line
        assert snapshot(run) == {**before, ".lock": (run / ".lock").read_bytes()}
    empty = tmp_path / "empty"  # an existing empty directory takes a new run
    empty.mkdir()
    with lock_directory(empty):
        assert pretrain("--set", "training.steps=1", "-o", str(empty)) == 2
        assert "in use by another popbert process" in error_line(capsys)
    assert list(empty.iterdir()) == []

    # A Trainer holds the lock from from_config to close(); an exception inside releases it.
    cfg = popbert.load_config("tiny", [*SMALL[1::2], "training.steps=1"])
    with pytest.raises(RuntimeError, match="stop here"), \
            popbert.Trainer.from_config(cfg, empty) as trainer:
        assert (empty / ".lock").is_file()
        with pytest.raises(popbert.PopbertError, match="in use by another popbert process"):
            popbert.Trainer.from_config(cfg, empty)
        assert trainer.output_dir == empty
        raise RuntimeError("stop here")
    assert not (empty / ".lock").exists()
    with lock_directory(empty):  # free again
        pass
    assert pretrain("--set", "training.steps=1", "-o", str(empty), "--overwrite") == 0
    assert steps_logged(empty) == [1]
