"""A directory belongs to one run: the refusal rule for a new run (`check_new_run_dir`,
`clear_run_dir`, `claim_run_dir`) and the directory lock (`popbert.locking`), without training.
The CLI and Trainer side: tests/train/test_run_lifecycle.py."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from popbert.errors import UsageError
from popbert.io import run_dir
from popbert.io.run_dir import check_new_run_dir, claim_run_dir, clear_run_dir, foreign_files
from popbert.locking import LOCK_FILE, describe_holder, lock_directory


def fake_run(path: Path, *extra: str) -> Path:
    """A directory holding a run's files (and `extra` files of the user's)."""
    (path / "checkpoints" / "step-000002").mkdir(parents=True)
    (path / "checkpoints" / "step-000002" / "state.json").write_text("{}")
    (path / "config.yaml").write_text("training: {steps: 2}\n")
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n')
    for name in extra:
        (path / name).write_text("mine")
    return path


# ---------------------------------------------------------------------------------------------
# The rule


def test_a_missing_or_empty_directory_takes_a_new_run(tmp_path: Path) -> None:
    assert check_new_run_dir(tmp_path / "missing") is False
    assert check_new_run_dir(tmp_path) is False
    (tmp_path / LOCK_FILE).write_text("{}")  # a crashed run's lock file is not a run
    (tmp_path / ".tmp-config.yaml-1-ab").write_text("torn")  # nor a torn atomic write
    assert check_new_run_dir(tmp_path) is False


def test_a_directory_holding_a_run_is_refused_unless_overwritten(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "ref")
    with pytest.raises(UsageError) as refused:
        check_new_run_dir(run)
    message = str(refused.value)
    assert message.startswith(f"--output-dir {run}: holds another run (")
    assert "checkpoints/" in message and "config.yaml" in message
    assert f"--resume {run}" in message and "--overwrite" in message
    assert check_new_run_dir(run, overwrite=True) is True
    assert (run / "metrics.jsonl").is_file()  # checking deletes nothing
    for name in ("vocab.txt", "eval_results.json", "import.json"):  # any of popbert's files
        other = tmp_path / name.replace(".", "-")
        other.mkdir()
        (other / name).write_text("x")
        with pytest.raises(UsageError, match="holds another run"):
            check_new_run_dir(other)


def test_files_popbert_did_not_write_are_never_cleared(tmp_path: Path) -> None:
    mixed = fake_run(tmp_path / "mixed", "notes.txt")
    with pytest.raises(UsageError) as refused:
        check_new_run_dir(mixed, overwrite=True)
    assert "files popbert did not write (notes.txt)" in str(refused.value)
    assert "--overwrite will not clear it" in str(refused.value)
    with pytest.raises(UsageError, match="not cleared"):
        clear_run_dir(mixed)
    assert (mixed / "notes.txt").read_text() == "mine" and (mixed / "config.yaml").is_file()

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.h5").write_text("shard")
    for overwrite in (False, True):
        with pytest.raises(UsageError, match=r"is not empty \(data.h5\) and holds no popbert run"):
            check_new_run_dir(theirs, overwrite=overwrite)

    nested = fake_run(tmp_path / "nested")
    (nested / "checkpoints" / "keep-me").mkdir()
    assert foreign_files(nested) == ["checkpoints/keep-me"]
    with pytest.raises(UsageError, match="checkpoints/keep-me"):
        check_new_run_dir(nested, overwrite=True)


def test_clearing_deletes_the_run_and_keeps_the_lock(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "ref", "metrics.png", "wandb_run_id")
    (run / "wandb").mkdir()
    with lock_directory(run):
        removed = clear_run_dir(run)
        assert sorted(p.name for p in removed) == ["checkpoints", "config.yaml", "metrics.jsonl",
                                                   "metrics.png", "wandb", "wandb_run_id"]
        assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    assert list(run.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Claiming a directory: create, lock, check


def test_a_claim_locks_and_its_release_unlocks(tmp_path: Path) -> None:
    run = tmp_path / "new" / "run"
    claim = claim_run_dir(run)
    assert claim.created and not claim.clear_first and (run / LOCK_FILE).is_file()
    holder = json.loads((run / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(UsageError) as refused:  # a second claim, even from this process
        claim_run_dir(run, new_run=False)
    assert f"held by pid {os.getpid()} on host {socket.gethostname()} since" in str(
        refused.value)
    claim.release()
    assert not (run / LOCK_FILE).exists() and run.is_dir()
    claim_run_dir(run).release(failed=True)  # not created by this claim: kept
    assert run.is_dir()
    again = claim_run_dir(tmp_path / "other")
    again.release(failed=True)  # created and never checkpointed: removed
    assert not (tmp_path / "other").exists()


def test_a_refused_claim_leaves_the_directory_unlocked(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "ref")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(UsageError, match="holds another run"):
        claim_run_dir(run)
    assert not (run / LOCK_FILE).exists()
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    claim_run_dir(run, new_run=False).release()  # a resume is only locked


def test_overwrite_waits_for_start_and_spares_the_runs_sources(tmp_path: Path) -> None:
    run = fake_run(tmp_path / "ref")
    with pytest.raises(UsageError, match="--overwrite would delete the run --resume continues"):
        claim_run_dir(run, new_run=False, overwrite=True)
    with pytest.raises(UsageError, match="--init-from .*step-000002 lies in it"):
        claim_run_dir(run, overwrite=True,
                      sources=[("--init-from", run / "checkpoints" / "step-000002")])
    claim = claim_run_dir(run, overwrite=True, sources=[("--init-from", tmp_path / "elsewhere"),
                                                       ("data.vocab_file", None)])
    assert claim.clear_first and (run / "config.yaml").is_file()  # nothing deleted yet
    claim.start()
    assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    claim.release()


def test_only_replica_0_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    from popbert.distributed import Replicas
    from popbert.errors import ConfigError
    from popbert.train.trainer import _launch_rank

    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    assert _launch_rank(None) == 0
    assert _launch_rank(Replicas(rank=1, size=2)) == 1  # a caller's group: its rank
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")  # torchrun's, before the replicas are joined
    assert _launch_rank(None) == 3
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match=r"\$RANK"):
        _launch_rank(None)


# ---------------------------------------------------------------------------------------------
# The lock


HOLDER = """
import sys, time
from popbert.locking import lock_directory
lock = lock_directory(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_another_process_holding_the_lock_is_named_and_its_death_frees_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError) as refused:
            lock_directory(tmp_path)
        message = str(refused.value)
        assert message.startswith(f"{tmp_path}: in use by another popbert process")
        assert re.search(rf"held by pid {holder.pid} on host {re.escape(socket.gethostname())} "
                         r"since \d\d:\d\d\); wait for it to end", message), message
    finally:
        holder.kill()  # SIGKILL: no clean-up, the lock file stays behind
        holder.wait()
    assert (tmp_path / LOCK_FILE).is_file()
    with caplog.at_level(logging.INFO, logger="popbert.locking"), lock_directory(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"removed the lock of a process that ended without releasing it (pid {holder.pid}" \
        in caplog.text
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_release_is_idempotent_and_a_foreign_lock_file_is_not_removed(tmp_path: Path) -> None:
    lock = lock_directory(tmp_path)
    assert lock.held
    (tmp_path / LOCK_FILE).unlink()  # someone deleted it by hand; another process made one
    (tmp_path / LOCK_FILE).write_text('{"pid": 1}')
    lock.release()
    lock.release()
    assert not lock.held
    assert (tmp_path / LOCK_FILE).read_text() == '{"pid": 1}'


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_neither_keeps_nor_drops_the_parents_lock(tmp_path: Path) -> None:
    """A data worker forked while a stage holds its directory closes its copy of the lock at
    once: the parent keeps the lock, and a worker outliving a killed parent holds nothing."""
    lock = lock_directory(tmp_path)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether it still holds a copy, then exit at once
        os.write(write, b"held" if lock.held else b"free")
        lock.release()  # a no-op in the child: nothing to unlock, no file to remove
        os._exit(0)
    os.close(write)
    assert os.read(read, 4) == b"free"
    os.waitpid(pid, 0)
    os.close(read)
    assert lock.held and (tmp_path / LOCK_FILE).is_file()
    with pytest.raises(UsageError, match="in use"):
        lock_directory(tmp_path)
    lock.release()


def test_the_holder_reads_as_one_phrase() -> None:
    now = time.time()
    text = describe_holder({"pid": 1234, "host": "gpu-3", "started": now})
    assert text == f"pid 1234 on host gpu-3 since {time.strftime('%H:%M', time.localtime(now))}"
    assert describe_holder({"pid": 1, "started": now - 3 * 86400}).startswith("pid 1 since 20")
    assert describe_holder({}) == "another process"


def test_a_stage_directory_is_locked_while_its_stage_runs(tmp_path: Path) -> None:
    from popbert.data.stages import StageDir

    out = tmp_path / "stage"
    stage = StageDir(out, "sentences", {"seed": 1}).open()
    assert (out / LOCK_FILE).is_file()
    with pytest.raises(UsageError, match="in use by another popbert process"):
        StageDir(out, "sentences", {"seed": 1}).open()
    stage.finish([], {})
    assert not (out / LOCK_FILE).exists()
    stage = StageDir(out, "sentences", {"seed": 1}).open()  # a re-run takes it again
    stage.release()
    abandoned = StageDir(tmp_path / "empty", "sentences", {"seed": 1}).open()
    abandoned.abandon("nothing")
    assert not (tmp_path / "empty").exists()  # lock file and all


def test_run_dir_keeps_one_rule(tmp_path: Path) -> None:
    """The names the rule treats as popbert's include every file a run writes."""
    for name in ("config.yaml", "model.onnx", "metrics.jsonl", "metrics.png",
                 "model.inference.onnx", "vocab.txt", "eval_results.json", "predictions.json",
                 "nbest_predictions.json", "eval_predictions.jsonl", "import.json",
                 "wandb_run_id", "wandb", LOCK_FILE, "checkpoints"):
        assert name in run_dir.RUN_FILES, name


def test_a_restart_tidies_what_a_kill_left_mid_write(tmp_path: Path) -> None:
    """The temporaries of an atomic write a kill interrupted (a half-written config.yaml, a
    checkpoint directory, an old checkpoint being deleted) go; another process's lock file in
    the making and everything else stay (issue 20, item 4)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000003").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step-000006-123").mkdir()
    (run / "checkpoints" / ".tmp-deleted-step-000001-123").mkdir()
    (run / ".tmp-config.yaml-123-abcd").write_text("torn")
    (run / ".tmp-model.inference.onnx-xyz").mkdir()
    (run / f".tmp-{LOCK_FILE}-456-beef").write_text("")
    (run / "config.yaml").write_text("x")
    removed = run_dir.clean_interrupted(run)
    assert sorted(p.name for p in removed) == [
        ".tmp-config.yaml-123-abcd", ".tmp-deleted-step-000001-123",
        ".tmp-model.inference.onnx-xyz", ".tmp-step-000006-123"]
    assert sorted(p.name for p in run.iterdir()) == [f".tmp-{LOCK_FILE}-456-beef", "checkpoints",
                                                     "config.yaml"]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000003"]
