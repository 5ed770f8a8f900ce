"""popbert.io.checkpoint: which checkpoint a run directory resolves to when one is incomplete,
and a full disk while one is written (issue 20, item 2)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

from popbert import atomic
from popbert.errors import CheckpointError, WriteError
from popbert.io.checkpoint import Checkpoint, find_checkpoint, load_checkpoint, save_checkpoint


def saved(run: Path, step: int) -> Path:
    directory = run / "checkpoints" / f"step-{step:06d}"
    save_checkpoint(directory, Checkpoint(step=step, weights={"w": torch.full((2,), float(step))}),
                    "training: {steps: 9}\n")
    return directory


def test_an_incomplete_newest_checkpoint_is_named_and_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    (run / "config.yaml").parent.mkdir(parents=True)
    (run / "config.yaml").write_text("training: {steps: 9}\n")  # a run directory's own
    saved(run, 2)
    for step in (4, 6):
        (saved(run, step) / "state.json").unlink()
    with caplog.at_level(logging.WARNING, logger="popbert"):
        assert find_checkpoint(run) == run / "checkpoints" / "step-000002"
    assert (f"{run}: skipping incomplete checkpoints step-000004, step-000006 (no state.json); "
            "using step-000002") in caplog.text
    assert load_checkpoint(run).step == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="popbert"):
        find_checkpoint(run, warn=False)
    assert not caplog.text
    # Named directly: refused in one line.
    with pytest.raises(CheckpointError, match="step-000006: incomplete checkpoint \\(no "
                                              "state.json\\); resume the run directory"):
        load_checkpoint(run / "checkpoints" / "step-000006")
    # Nothing complete at all: the error says which are incomplete.
    (run / "checkpoints" / "step-000002" / "state.json").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint here .*incomplete \\(no "
                                              "state.json\\): step-000002, step-000004"):
        find_checkpoint(run)


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors' own writer is not used (its SafetensorError hid the errno): every file goes
    through popbert.atomic, so a full disk is a WriteError naming the checkpoint."""
    run = tmp_path / "run"
    directory = saved(run, 4)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "_create", full)
    with pytest.raises(WriteError, match=f"^{directory}: cannot write: No space left on device$"):
        saved(run, 4)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004"]


@pytest.mark.parametrize("name", ["weights.safetensors", "optimizer.pt", "rng.pt"])
def test_bytes_changed_after_the_save_are_one_line_not_loaded(name: str, tmp_path: Path) -> None:
    """A byte flipped inside a tensor's data keeps safetensors' header and torch's zip readable:
    only the SHA-256 saved in state.json tells the damaged file from the saved one."""
    directory = tmp_path / "step-000003"
    save_checkpoint(directory, Checkpoint(step=3, weights={"w": torch.arange(64.0)},
                                          optimizer={"state": {"m": torch.ones(64)}},
                                          rng={"cpu": torch.zeros(8, dtype=torch.uint8)}),
                    "training: {steps: 9}\n")
    assert load_checkpoint(directory).step == 3  # as saved: read
    path = directory / name
    data = bytearray(path.read_bytes())
    at = data.rfind(b"\x00\x00\x80\x3f") if name != "rng.pt" else data.rfind(b"\x00" * 8)
    assert at > 0  # a float 1.0 of the tensors (the rng's zeros), not the header
    data[at] ^= 0x01  # one bit of one value: a disk's or a copy's error
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{name}: its contents changed after the "
                                              "checkpoint was saved"):
        load_checkpoint(directory)
    if name == "weights.safetensors":
        with pytest.raises(CheckpointError, match="contents changed"):
            load_checkpoint(directory, weights_only=True)
    else:
        assert load_checkpoint(directory, weights_only=True).step == 3  # not read then


def test_a_checkpoint_saved_before_the_checksums_still_loads(tmp_path: Path) -> None:
    import json

    directory = saved(tmp_path / "run", 2)
    state = json.loads((directory / "state.json").read_text())
    assert set(state.pop("sha256")) == {"weights.safetensors", "optimizer.pt", "rng.pt"}
    (directory / "state.json").write_text(json.dumps(state))
    assert load_checkpoint(directory).step == 2
