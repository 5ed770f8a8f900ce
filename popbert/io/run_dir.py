"""A run's output directory: where it is, that it can be written, and what a crash left in it.

A run directory holds `config.yaml`, `model.onnx`, `metrics.jsonl`, `metrics.png`,
`checkpoints/step-NNNNNN/` and the inference export. `--resume DIR` continues in that same
directory, so a second crash loses nothing either.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from popbert.atomic import restore_interrupted
from popbert.errors import UsageError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step-"


def step_dir(output_dir: Path, step: int) -> Path:
    """The checkpoint directory of `step` in a run directory."""
    return Path(output_dir) / CHECKPOINTS / f"{STEP_PREFIX}{step:06d}"


def run_dir_of(path: Path) -> Path:
    """The run directory of `path`: a run directory itself, or one of its checkpoints."""
    path = Path(path)
    if path.parent.name == CHECKPOINTS and (path / "state.json").exists():
        return path.parent.parent
    return path


def check_output_dir(path: Path, flag: str = "--output-dir") -> None:
    """Fail with one line, before anything is written, if `path` cannot be a run directory:
    it is a file, sits under a file, or its nearest existing ancestor is not writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a directory")
    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {ancestor} is not writable")


def create_output_dir(path: Path, flag: str = "--output-dir") -> bool:
    """Create the run directory (checked with :func:`check_output_dir` first); returns whether
    it was created now. A filesystem that refuses (read-only, permissions that root's
    `os.access` does not see) is the same one-line error."""
    path = Path(path)
    check_output_dir(path, flag)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".popbert-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        if created and error.errno != errno.EEXIST:
            shutil.rmtree(path, ignore_errors=True)
        raise UsageError(f"{flag} {path}: cannot write there ({reason})") from None
    return created


def clean_interrupted(output_dir: Path) -> list[Path]:
    """Tidy what a kill during a checkpoint write left: a previous checkpoint set aside by a
    replace is put back, temporary `.tmp-*` directories are removed. Returns what was removed."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    for aside in root.glob(".old-*"):
        name = aside.name[len(".old-"):].rsplit("-", 1)[0]
        restore_interrupted(root / name)
    removed = []
    for tmp in sorted(root.glob(".tmp-*")):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        removed.append(tmp)
    if removed:
        log.info("removed %d unfinished checkpoint write(s) in %s", len(removed), root)
    return removed


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if (p / "state.json").is_file())


def prune_checkpoints(output_dir: Path, keep: int, final: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (0 keeps all); `final` is always kept on
    top of them. Returns the deleted directories."""
    if keep <= 0:
        return []
    others = [p for p in checkpoint_dirs(output_dir) if final is None or p != Path(final)]
    doomed = others[:-keep] if len(others) > keep else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        log.debug("removed old checkpoints: %s", ", ".join(p.name for p in doomed))
    return doomed


def remove_if_empty_run(output_dir: Path, created: bool) -> None:
    """After a failure: a directory this run created and never checkpointed holds nothing worth
    keeping, so it goes (a bad input leaves nothing half-written)."""
    if created and not checkpoint_dirs(output_dir):
        shutil.rmtree(output_dir, ignore_errors=True)


__all__ = ["check_output_dir", "checkpoint_dirs", "clean_interrupted", "create_output_dir",
           "prune_checkpoints", "remove_if_empty_run", "run_dir_of", "step_dir"]
