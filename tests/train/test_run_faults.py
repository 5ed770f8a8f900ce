"""Every fault a clean stop (issue 20, item 2): a full disk at each of a run's writes, SIGTERM and
SIGUSR1 from a scheduler, an incomplete newest checkpoint, a run stopped after its last step. Each
ends in one line, leaves nothing half-written, and the run resumes to the numbers of a run that
never stopped."""

from __future__ import annotations

import builtins
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from trainer_helpers import ModelledTime, count_budget_time, model_budget_time

from popbert import atomic
from popbert.cli.main import main
from popbert.io.checkpoint import load_checkpoint
from popbert.io.run_dir import checkpoint_dirs
from popbert.observe import tracking

# A tiny run, fast on 2 CPU cores; one thread, so in-process and subprocess runs compute alike.
SMALL = ["--set", "model.num_layers=1", "--set", "model.hidden_size=32",
         "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
         "--set", "model.sequence_length=32", "--set", "model.max_position_embeddings=32",
         "--set", "model.max_predictions_per_seq=5", "--set", "execution.micro_batch_size=8",
         "--set", "model.hidden_dropout=0.1", "--set", "execution.threads=1",
         "--set", "training.log_every=1", "--set", "optimizer.warmup_steps=2"]
STEPS = ["--set", "training.steps=40", "--set", "training.checkpoint_every=10"]
TIMING = ("seq_per_s", "elapsed_s")


def pretrain(*args: str) -> int:
    return main(["pretrain", *SMALL, *args])


def weights(run: Path, step: int = 40) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(
        str(run / "checkpoints" / f"step-{step:06d}" / "weights.safetensors"))


def records(run: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(run: Path, reference: Path) -> None:
    """Bit-identical final weights and export, the same records (timings aside)."""
    ours, theirs = weights(run), weights(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert records(run) == records(reference)
    assert (run / "model.inference.onnx").read_bytes() == \
        (reference / "model.inference.onnx").read_bytes()
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("popbert:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def leftovers(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*")
                  if p.name.startswith((".tmp-", ".old-")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run that never stopped."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert pretrain("-o", str(run), *STEPS) == 0
    return run


# ---------------------------------------------------------------------------------------------
# A full disk


def no_space(monkeypatch: pytest.MonkeyPatch, name: str, after: int = 0) -> None:
    """The disk fills up at the `after`-th write of a file called `name` (0: the first) through
    popbert.atomic: half its bytes land, then ENOSPC, as a real full disk does."""
    create = atomic._create
    seen = [0]

    def filling(path: Path, data: bytes) -> None:
        if name in path.name:
            seen[0] += 1
            if seen[0] > after:
                create(path, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        create(path, data)

    monkeypatch.setattr(atomic, "_create", filling)


def metrics_fill_after(monkeypatch: pytest.MonkeyPatch, lines: int) -> None:
    """metrics.jsonl takes `lines` records, then half of the next one and ENOSPC."""

    class Filling:
        def __init__(self, file: Any) -> None:
            self.file, self.left = file, lines

        def write(self, text: str) -> int:
            if self.left == 0:
                self.file.write(text[: len(text) // 2])
                self.file.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= 1
            return self.file.write(text)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)

    def opened(path: Any, mode: str = "r", **kwargs: Any) -> Any:
        file = builtins.open(path, mode, **kwargs)
        return Filling(file) if "a" in mode else file  # the logger's appends, not its reads

    monkeypatch.setattr(tracking, "open", opened, raising=False)


@pytest.mark.e2e
@pytest.mark.parametrize("site", ["checkpoint", "graph", "metrics", "plot", "export"])
def test_a_full_disk_is_one_line_and_the_run_resumes_to_the_same_numbers(
        site: str, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    path = {"checkpoint": run / "checkpoints" / "step-000020", "graph": run / "model.onnx",
            "metrics": run / "metrics.jsonl", "plot": run / "metrics.png",
            "export": run / "model.inference.onnx"}[site]
    with monkeypatch.context() as patch:
        if site == "checkpoint":
            no_space(patch, "weights.safetensors", after=1)  # step 10's is written, 20's not
        elif site == "metrics":
            metrics_fill_after(patch, 25)
        else:
            no_space(patch, path.name)
        capsys.readouterr()
        assert pretrain("-o", str(run), *STEPS) == 2
    line = error_line(capsys)
    assert line.startswith(f"popbert: error: {path}: cannot write: No space left on device"), \
        line
    if site == "graph":  # before anything of value: the run directory goes
        assert not run.exists()
        return
    assert leftovers(run) == []  # nothing half-written
    assert f"continue with --resume {run}" in line, line
    for checkpoint in checkpoint_dirs(run):
        load_checkpoint(checkpoint)  # every checkpoint on disk is whole
    newest = checkpoint_dirs(run)[-1]
    assert f"(newest: {newest})" in line, line
    if site == "metrics":
        text = (run / "metrics.jsonl").read_text()
        assert text.endswith("\n") and len(text.splitlines()) == 25  # no torn line
    if site in ("plot", "export"):  # after the final checkpoint: the resume only finishes it
        assert newest.name == "step-000040"
    assert pretrain("--resume", str(run)) == 0
    assert_same_run(run, reference)


@pytest.mark.e2e
def test_a_file_in_the_way_of_a_checkpoint_is_one_line_and_the_run_resumes(
        reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Something other than a full disk stops a checkpoint mid-run (here a file put where step
    20's directory goes after step 10's was written): one line naming it and the newest
    checkpoint kept, no traceback, and once the file is gone the run resumes to the numbers of
    one that never stopped."""
    from popbert.io import checkpoint as ckpt

    run = tmp_path / "run"
    in_the_way = run / "checkpoints" / "step-000020"
    save = ckpt.save_checkpoint

    def save_then_block(directory: Path, *args: Any, **kwargs: Any) -> Any:
        if Path(directory).name == in_the_way.name:
            in_the_way.write_text("not a checkpoint")
        return save(directory, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "save_checkpoint", save_then_block)
        capsys.readouterr()
        assert pretrain("-o", str(run), *STEPS) == 2
    line = error_line(capsys)
    assert line.startswith(f"popbert: error: {in_the_way}: cannot write: "), line
    assert f"(newest: {run / 'checkpoints' / 'step-000010'})" in line, line
    assert f"continue with --resume {run}" in line, line
    assert leftovers(run) == []
    in_the_way.unlink()
    assert pretrain("--resume", str(run)) == 0
    assert_same_run(run, reference)


@pytest.mark.e2e
def test_a_full_disk_while_rehearsing_a_budgets_finish_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Under a time budget the run first writes a checkpoint, the export and a plot into a
    scratch directory (to measure them); a full disk there is the same one line, and a run that
    never checkpointed leaves no directory behind."""
    run = tmp_path / "run"
    write_text = Path.write_text

    def full(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.parent.name.startswith(".tmp-rehearsal-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    capsys.readouterr()
    assert pretrain("-o", str(run), "--set", "training.time_budget=60") == 2
    line = error_line(capsys)
    assert line == (f"popbert: error: {run / 'checkpoints'}: cannot write: No space left on "
                    "device; no checkpoint was written yet"), line
    assert not run.exists()


# ---------------------------------------------------------------------------------------------
# SIGTERM and SIGUSR1


def started(command: list[str], run: Path, env: dict[str, str] | None = None
            ) -> subprocess.Popen[str]:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_for_step(run: Path, step: int, processes: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 120
    metrics = run / "metrics.jsonl"
    while True:
        try:
            if json.loads(metrics.read_text().splitlines()[-1])["step"] >= step:
                return
        except (OSError, IndexError, ValueError):  # not there yet, or a line half-read
            pass
        assert all(p.poll() is None for p in processes), "the run ended early"
        assert time.monotonic() < deadline, "the run never reached its step"
        time.sleep(0.01)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_checkpoints_the_step_and_exits_for_a_requeue(
        name: str, reference: Path, tmp_path: Path) -> None:
    """A scheduler's signal: the run finishes its step, checkpoints it, says so in one line and
    exits 128 + the signal; `--resume` then ends bit-identical to the run that never stopped."""
    number = getattr(signal, name)
    run = tmp_path / "run"
    process = started([sys.executable, "-m", "popbert", "pretrain", *SMALL, *STEPS,
                       "-o", str(run)], run)
    wait_for_step(run, 3, [process])
    process.send_signal(number)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + number, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("popbert:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    step = records(run)[-1]["step"]
    assert 3 <= step < 40
    checkpoint = run / "checkpoints" / f"step-{step:06d}"
    assert lines[0] == (f"popbert: stopped by {name} at step {step}; checkpoint {checkpoint}; "
                        f"resume with --resume {run}"), lines[0]
    assert load_checkpoint(checkpoint).step == step
    assert leftovers(run) == [] and not (run / "model.inference.onnx").exists()
    assert (run / "metrics.png").is_file()
    assert pretrain("--resume", str(run)) == 0
    assert_same_run(run, reference)


@pytest.mark.e2e
def test_replicas_stop_at_the_same_step_when_one_is_signalled(tmp_path: Path) -> None:
    """Under two replicas (gloo) only replica 1 gets SIGTERM: both stop after the same step,
    replica 0 writes that step's checkpoint, and both exit 143."""
    from replica_helpers import free_port

    run = tmp_path / "run"
    port = str(free_port())
    command = [sys.executable, "-m", "popbert", "pretrain", *SMALL, "-o", str(run),
               "--set", "execution.replicas=2", "--set", "training.steps=100000",
               "--set", "training.checkpoint_every=1000"]
    processes = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        processes.append(started(command, run, env))
    try:
        wait_for_step(run, 3, processes)
        processes[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=120)[1] for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert [p.returncode for p in processes] == [143, 143], [e[-2000:] for e in errs]
    step = records(run)[-1]["step"]
    checkpoint = run / "checkpoints" / f"step-{step:06d}"
    for err in errs:
        lines = [line for line in err.splitlines() if line.startswith("popbert:")]
        assert lines == [f"popbert: stopped by SIGTERM at step {step}; checkpoint {checkpoint}; "
                         f"resume with --resume {run}"], err[-2000:]
    assert load_checkpoint(checkpoint).step == step
    assert [p.name for p in checkpoint_dirs(run)] == [checkpoint.name]


# ---------------------------------------------------------------------------------------------
# Incomplete checkpoints, a run stopped after its last step


@pytest.mark.e2e
def test_an_incomplete_newest_checkpoint_is_skipped_by_name_or_refused(
        reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    assert pretrain("-o", str(run), *STEPS) == 0
    incomplete = run / "checkpoints" / "step-000040"
    (incomplete / "state.json").unlink()
    before = sorted(p.name for p in incomplete.iterdir())
    capsys.readouterr()
    # Named directly: refused, and nothing is written into it (no lock, no run files).
    assert pretrain("--resume", str(incomplete)) == 2
    line = error_line(capsys)
    assert line == (f"popbert: error: {incomplete}: incomplete checkpoint (no state.json); "
                    "resume the run directory to use its newest complete checkpoint, or "
                    "name another one"), line
    assert sorted(p.name for p in incomplete.iterdir()) == before
    # The run directory: step 40 is named in a warning and skipped; the run goes on from 30.
    with caplog.at_level("INFO", logger="popbert"):
        assert pretrain("--resume", str(run)) == 0
    assert (f"{run}: skipping incomplete checkpoint step-000040 (no state.json); using "
            "step-000030") in caplog.text
    assert "trained 10 steps (30 → 40)" in caplog.text
    assert_same_run(run, reference)


@pytest.mark.e2e
def test_a_run_stopped_after_its_last_checkpoint_is_finished_by_resume(
        reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Killed after its final checkpoint, before its export: `--resume` writes the export, the
    plot and the final metrics without training (it used to ask to raise training.steps)."""
    from popbert.train.pretrain import PretrainingJob

    run = tmp_path / "run"

    def killed(self: PretrainingJob, trainer: Any, directory: Path | None = None) -> Path:
        raise KeyboardInterrupt  # the process ends here, as under a kill

    with monkeypatch.context() as patch:
        patch.setattr(PretrainingJob, "export", killed)
        assert pretrain("-o", str(run), *STEPS) == 130
    assert not (run / "model.inference.onnx").exists()
    (run / "metrics.png").unlink()
    with caplog.at_level("INFO", logger="popbert"):
        assert pretrain("--resume", str(run)) == 0
    assert "finishing the run (export, plot) without training" in caplog.text
    assert "trained 0 steps (40 → 40)" in caplog.text
    assert_same_run(run, reference)
    # A finished run resumed again: the same outputs again; a lower training.steps is refused.
    assert pretrain("--resume", str(run)) == 0
    assert_same_run(run, reference)
    assert pretrain("--resume", str(run), "--set", "training.steps=30") == 2


def test_a_budgeted_run_stopped_after_its_final_checkpoint_is_finished_by_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The same under a time budget: the final checkpoint says it ended the budget, so
    `--resume` with that budget writes the export without training; a larger budget trains on."""
    from popbert.train.pretrain import PretrainingJob

    count_budget_time(monkeypatch)  # the same steps however loaded the machine is
    run = tmp_path / "run"
    budget = ["--set", "training.time_budget=3s", "--set", "training.steps=1000"]
    export = PretrainingJob.export

    def killed(self: PretrainingJob, trainer: Any, directory: Path | None = None) -> Path:
        if directory is not None:  # the budget's rehearsal of its finish, into scratch
            return export(self, trainer, directory)
        raise KeyboardInterrupt  # the process ends here, as under a kill

    with monkeypatch.context() as patch:
        patch.setattr(PretrainingJob, "export", killed)
        assert pretrain("-o", str(run), *budget) == 130
    final = checkpoint_dirs(run)[-1]
    state = json.loads((final / "state.json").read_text())["trainer"]
    assert state["budget_done"] == 3.0
    before = weights(run, int(final.name.split("-")[1]))
    with caplog.at_level("INFO", logger="popbert"):
        assert pretrain("--resume", str(run)) == 0
    assert "without training (a larger training.time_budget trains on)" in caplog.text
    assert (run / "model.inference.onnx").is_file() and (run / "metrics.png").is_file()
    assert checkpoint_dirs(run)[-1] == final  # no step was trained
    after = weights(run, int(final.name.split("-")[1]))
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    caplog.clear()
    with caplog.at_level("INFO", logger="popbert"):
        assert pretrain("--resume", str(run), "--set", "training.time_budget=5s") == 0
    assert "without training" not in caplog.text
    assert checkpoint_dirs(run)[-1] != final  # trained on


def test_a_budget_too_small_to_train_is_refused_saying_the_least(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """On a modelled machine (a step 0.2 s, a checkpoint 0.3 s, the export 0.2 s, the plot
    0.1 s) the first step and the rehearsal of the finish after it take 0.8 s, and 1.2 x 0.6 s
    + 0.5% of the budget is kept for the real finish: a 1 s budget has no room for it and is
    refused in one line naming the least budget (0.8 + 0.725 s), leaving nothing; 1.6 s trains
    that one step and ends within it (0.8 + 0.6 s), 5 s trains more, also within it."""
    model_budget_time(monkeypatch, ModelledTime(lambda rows, length: 0.2, checkpoint=0.3,
                                                export=0.2, plot=0.1))
    run = tmp_path / "run"
    capsys.readouterr()
    assert pretrain("-o", str(run), "--set", "training.time_budget=1",
                    "--set", "training.steps=100") == 2
    line = error_line(capsys)
    assert line == ("popbert: error: training.time_budget is 1 s, but this run's first step "
                    "took 0.2 s and its final checkpoint and export take about 0.6 s "
                    "(measured): give it more than 1.52 s"), line
    assert not run.exists()
    for budget, steps, spent in (("1.6", [1], 1.4), ("5", range(2, 100), None)):
        assert pretrain("-o", str(run), "--set", f"training.time_budget={budget}", "--overwrite",
                        "--set", "training.steps=100") == 0
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["step"] in steps and records[-1]["elapsed_s"] <= float(budget)
        final = checkpoint_dirs(run)[-1]
        saved = json.loads((final / "state.json").read_text())["trainer"]["elapsed_s"]
        assert saved <= float(budget)
        if spent is not None:  # 1 step + rehearsal, then the final checkpoint, export and plot
            assert saved == pytest.approx(0.8) and \
                f"time budget: {spent} s of {budget} s spent" in capsys.readouterr().err


def test_under_a_budget_the_evaluations_are_sized_and_said_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """On the counting clock (a batch 0.05 s, timing two 0.1 s) 4 points of 2 batches do not
    fit in 25% of a 1 s budget: 1 point (the final weights'), said once before the first step."""
    count_budget_time(monkeypatch)
    with caplog.at_level("INFO", logger="popbert"):
        assert pretrain("-o", str(tmp_path / "run"), "--set", "training.time_budget=1",
                        "--set", "training.eval_points=4", "--set", "training.eval_batches=2",
                        "--set", "data.validation_fraction=0.05") == 0
    messages = [r.getMessage() for r in caplog.records]
    said = [m for m in messages if m.startswith("evaluation:")]
    assert said == ["evaluation: 1 point of 2 batches, about 0.1 s in all (a batch 0.05 s), at "
                    "most 25% of the 1 s budget (0.25 s) with 0.1 s timing it; the 4 points of "
                    "2 batches asked for would take 0.4 s; evaluations are outside the budget"]
    first_step = next(i for i, m in enumerate(messages) if m.startswith("time budget: the first"))
    assert messages.index(said[0]) < first_step
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "val_loss" in r] == [records[-1]["step"]]
