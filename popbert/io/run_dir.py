"""A run's output directory: where it is, that it can be written, whose it is, and what a crash
left in it.

A run directory holds `config.yaml`, `model.onnx`, `metrics.jsonl`, `metrics.png`,
`checkpoints/step-NNNNNN/` and the inference export. `--resume DIR` continues in that same
directory, so a second crash loses nothing either.

A directory belongs to one run. A new run refuses a directory that holds another one (its
metrics would be appended to the old run's, its checkpoints pruned, its config replaced), unless
`--overwrite` asks to delete that run first; a directory holding files popbert did not write is
never cleared. While a run lives, `.lock` in its directory is held with `flock`, so a second
process on the same directory (a new run or a `--resume`) stops with one line naming the
holder instead of interleaving its steps with the first's (:func:`claim_run_dir`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from popbert.atomic import remove_tree, restore_interrupted
from popbert.errors import UsageError
from popbert.locking import LOCK_FILE, DirectoryLock, lock_directory

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step-"

# What makes a directory a run: a new run there would mix with it.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", CHECKPOINTS)
# Everything popbert writes into a run directory (pre-training, fine-tuning, import-hf, W&B's
# offline files): `--overwrite` deletes only these, and only when nothing else is there.
RUN_FILES = frozenset({
    *RUN_MARKERS, LOCK_FILE, "model.onnx", "metrics.png", "model.inference.onnx",
    "model.inference.onnx.data", "vocab.txt", "tokenizer.json", "import.json",
    "eval_results.json",
    "eval_predictions.jsonl", "predictions.json", "nbest_predictions.json", "wandb_run_id",
    "wandb", ".torchrun.json"})
# The entries of a run that are directories; every other name in RUN_FILES is a file.
RUN_DIRECTORIES = frozenset({CHECKPOINTS, "wandb"})
# Temporary names of popbert's atomic writes, write probes and lock files being created.
_TEMP_PREFIXES = (".tmp-", ".popbert-write-test-")
_CHECKPOINT_PREFIXES = (STEP_PREFIX, ".tmp-", ".old-")


def step_dir(output_dir: Path, step: int) -> Path:
    """The checkpoint directory of `step` in a run directory."""
    return Path(output_dir) / CHECKPOINTS / f"{STEP_PREFIX}{step:06d}"


def run_dir_of(path: Path) -> Path:
    """The run directory of `path`: a run directory itself, or one of its checkpoints."""
    path = Path(path)
    if path.parent.name == CHECKPOINTS and (path / "state.json").exists():
        return path.parent.parent
    return path


def default_run_dir(job: str) -> Path:
    """Where a run given no output directory writes: `runs/<job>-<timestamp>`; under torchrun,
    a restart of a job finds its first attempt's directory again
    (`popbert.distributed.elastic.launched_run_dir`) rather than starting another."""
    from popbert.distributed.elastic import launched_run_dir

    root = Path("runs")
    return launched_run_dir(root, f"{job}-") or root / time.strftime(f"{job}-%Y%m%d-%H%M%S")


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
    replace is put back, temporary `.tmp-*` directories are removed, and so are the temporary
    files of a file write (config.yaml, metrics.png, the export) a kill left in the run
    directory (the run holds its lock: no other process writes there). Returns what was
    removed."""
    root = Path(output_dir) / CHECKPOINTS
    # Another process's lock file in the making is left alone (it finds ours and stops).
    leftovers = [p for p in Path(output_dir).glob(".tmp-*")
                 if not p.name.startswith(f".tmp-{LOCK_FILE}-")]
    if root.is_dir():
        for aside in root.glob(".old-*"):
            name = aside.name[len(".old-"):].rsplit("-", 1)[0]
            restore_interrupted(root / name)
        leftovers += root.glob(".tmp-*")
    removed = []
    for tmp in sorted(leftovers):
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        removed.append(tmp)
    if removed:
        log.info("removed %d unfinished write(s) in %s", len(removed), output_dir)
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
        remove_tree(path)  # a kill mid-delete leaves no torn checkpoint behind
    if doomed:
        log.debug("removed old checkpoints: %s", ", ".join(p.name for p in doomed))
    return doomed


def remove_if_empty_run(output_dir: Path, created: bool) -> None:
    """After a failure: a directory this run created and never checkpointed holds nothing worth
    keeping, so it goes (a bad input leaves nothing half-written)."""
    if created and not checkpoint_dirs(output_dir):
        shutil.rmtree(output_dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Whose directory: the refusal rule and the lock


def _is_run_file(name: str) -> bool:
    return name in RUN_FILES or name.startswith(_TEMP_PREFIXES)


def foreign_files(path: Path) -> list[str]:
    """Entries of `path` (and of its `checkpoints/`) that popbert did not write, sorted."""
    path = Path(path)
    if not path.is_dir():
        return []
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
                     if not _is_run_file(p.name))
    checkpoints = path / CHECKPOINTS
    if checkpoints.is_dir():
        foreign += sorted(f"{CHECKPOINTS}/{p.name}" for p in checkpoints.iterdir()
                          if not p.name.startswith(_CHECKPOINT_PREFIXES))
    elif checkpoints.exists():
        foreign.append(CHECKPOINTS)  # a file where popbert keeps a directory
    return foreign


def _listed(names: list[str], limit: int = 4) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_new_run_dir(path: Path, *, overwrite: bool = False,
                      flag: str = "--output-dir", resumable: bool = True) -> bool:
    """Whether a new run may use `path`, as one line before anything is written; returns
    whether it must first delete an earlier run there (`overwrite`).

    A missing or empty directory is fine. One that holds another run (its `config.yaml`,
    `metrics.jsonl`, `checkpoints/`, or any file popbert writes into a run) is refused: the new
    run would append to the old run's metrics, prune its checkpoints and replace its config and
    exports, and a later `--resume` would continue old weights under the new config. With
    `overwrite` that run is deleted first (:func:`clear_run_dir`), but only when every entry is
    popbert's: a directory holding anything else is never cleared (nor written into).
    `resumable`: the command has `--resume` (fine-tuning does not), for the advice given.
    """
    path = Path(path)
    if not path.is_dir():
        return False
    # The lock file and temporary names (a crash's leftovers, or another process's lock being
    # made right now) do not make a run.
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
                     if p.name != LOCK_FILE and not p.name.startswith(_TEMP_PREFIXES))
    if not entries:
        return False
    foreign = foreign_files(path)
    ours = [name for name in entries if name not in foreign]
    if foreign and not ours:
        raise UsageError(f"{flag} {path}: is not empty ({_listed(foreign)}) and holds no "
                         "popbert run: a new run needs a new or empty directory; choose "
                         "another one")
    held = f"{flag} {path}: holds another run ({_listed(ours)}); " + (
        f"continue it with --resume {path}, or choose another directory" if resumable
        else "choose another directory")
    if foreign:
        raise UsageError(f"{held}; it also holds files popbert did not write "
                         f"({_listed(foreign)}), so --overwrite will not clear it")
    if not overwrite:
        raise UsageError(f"{held}, or pass --overwrite to delete that run first")
    return True


def clear_run_dir(path: Path) -> list[Path]:
    """Delete the earlier run in `path` (after :func:`check_new_run_dir` allowed it): each of
    popbert's entries, the lock file excepted. Refuses, and deletes nothing, if anything in it
    is not popbert's. Returns what was deleted."""
    path = Path(path)
    foreign = foreign_files(path)
    if foreign:
        raise UsageError(f"{path}: holds files popbert did not write ({_listed(foreign)}); "
                         "not cleared")
    removed = []
    for entry in sorted(path.iterdir()):
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry)
    if removed:
        log.info("--overwrite: deleted the earlier run in %s (%s)", path,
                 _listed([p.name for p in removed]))
    return removed


@dataclass
class RunClaim:
    """Replica 0's hold on a run directory, from before the run writes anything to after its
    last write: the lock, whether the run created the directory, and whether an earlier run
    is to be deleted (`--overwrite`) when the run starts writing (not before: a run that fails
    its checks leaves the old one intact)."""

    directory: Path
    lock: DirectoryLock
    created: bool
    clear_first: bool = False

    def start(self) -> None:
        """Right before the run's first write: delete the earlier run when asked to."""
        if self.clear_first:
            clear_run_dir(self.directory)
            self.clear_first = False

    def release(self, failed: bool = False) -> None:
        """Let the directory go; after a failure (`failed`), a directory this run created and
        never checkpointed is removed first, still under the lock."""
        try:
            if failed:
                remove_if_empty_run(self.directory, self.created)
        finally:
            self.lock.release()


def _inside(path: Path | str, directory: Path) -> bool:
    if "://" in str(path):  # a URL (data on object storage) is in no local directory
        return False
    try:
        return Path(path).resolve().is_relative_to(Path(directory).resolve())
    except OSError:
        return False


def check_layout(path: Path, flag: str = "--output-dir") -> None:
    """One line when an entry of the run in `path` is of the wrong type: a directory where
    popbert writes a file (config.yaml, metrics.jsonl, ...), a file where it keeps a directory
    (checkpoints/, a checkpoints/step-*/). Checked before the run starts or resumes, so the
    first checkpoint or metrics line does not end it in a traceback."""
    path = Path(path)
    if not path.is_dir():
        return
    for name in sorted(RUN_FILES):
        entry = path / name
        if entry.exists() and entry.is_dir() != (name in RUN_DIRECTORIES):
            raise _misplaced(flag, path, entry, name in RUN_DIRECTORIES)
    checkpoints = path / CHECKPOINTS
    if checkpoints.is_dir():
        for entry in sorted(checkpoints.glob(f"{STEP_PREFIX}*")):
            if not entry.is_dir():
                raise _misplaced(flag, path, entry, True)


def _misplaced(flag: str, run: Path, entry: Path, directory: bool) -> UsageError:
    has, wants = ("a file", "a directory") if directory else ("a directory", "a file")
    return UsageError(f"{flag} {run}: {entry.relative_to(run)} is {has} where popbert keeps "
                      f"{wants}; move it out of the run directory")


def claim_run_dir(path: Path, *, new_run: bool = True, overwrite: bool = False,
                  sources: Iterable[tuple[str, Path | str | None]] = (),
                  flag: str = "--output-dir", resumable: bool = True) -> RunClaim:
    """Create `path` if needed, take its lock (:func:`lock_directory`) and, for a new run, check
    that it holds no other run (:func:`check_new_run_dir`; `--overwrite` deletes it at
    :meth:`RunClaim.start`). `sources`: (what, path) pairs the run reads from, e.g.
    ("--init-from", ...); `--overwrite` refuses to delete a directory one of them lies in.
    A resumed run (`new_run=False`) is only locked. Everything is one-line `UsageError`s."""
    path = Path(path)
    if overwrite and not new_run:
        raise UsageError(f"--overwrite would delete the run --resume continues in {path}; "
                         "resume without it, or start a new run")
    check_layout(path, flag)
    created = create_output_dir(path, flag)
    lock = lock_directory(path)
    try:
        clear_first = check_new_run_dir(path, overwrite=overwrite, flag=flag,
                                        resumable=resumable) if new_run else False
        if clear_first:
            for what, source in sources:
                if source is not None and _inside(Path(source), path):
                    raise UsageError(f"--overwrite would delete {path}, and {what} {source} "
                                     "lies in it: choose another directory")
    except BaseException:
        lock.release()
        raise
    return RunClaim(path, lock, created, clear_first)


__all__ = ["RUN_DIRECTORIES", "RUN_FILES", "RUN_MARKERS", "RunClaim", "check_layout",
           "check_new_run_dir", "check_output_dir",
           "default_run_dir",
           "checkpoint_dirs", "claim_run_dir", "clean_interrupted", "clear_run_dir",
           "create_output_dir", "foreign_files", "prune_checkpoints", "remove_if_empty_run",
           "run_dir_of", "step_dir"]
