"""Output paths of the `popbert` commands, checked before a command does any work.

A command that writes a file refuses a directory there, and one that writes a directory refuses
a file, in one line naming the flag: otherwise the write fails with a traceback once the work
(an export, a data stage, a plot) is done. Shared by `popbert.cli.main` and the command groups
it registers (`popbert.cli.data`, `popbert.cli.sweep`), which cannot import `main` back.
"""

from __future__ import annotations

from pathlib import Path

from popbert.errors import UsageError


def check_output_file(path: Path | None, flag: str) -> Path | None:
    """Refuse an output file `path` that cannot be written as a file: a directory, or a path
    under a file."""
    if path is None:
        return None
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; expected a file name")
    ancestor = path.parent
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a directory")
    return path


def check_output_directory(path: Path | None, flag: str = "--output-dir") -> Path | None:
    """Refuse an output directory that is a file, sits under one or cannot be written
    (`popbert.io.run_dir.check_output_dir`, as a run's directory is checked)."""
    if path is not None:
        from popbert.io.run_dir import check_output_dir

        check_output_dir(path, flag)
    return path


__all__ = ["check_output_directory", "check_output_file"]
