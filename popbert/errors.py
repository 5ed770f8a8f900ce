"""User-facing errors: anything the CLI turns into one `popbert: error: ...` line and exit 2.

Library code raises these (never `SystemExit`, never prints) so that callers embedding popbert can
catch one base class, while the CLI can tell a user mistake (bad config, missing checkpoint) from a
bug, which keeps its traceback.
"""

from __future__ import annotations


class PopbertError(Exception):
    """Base class for errors caused by the user's input rather than by a bug in popbert."""


class ConfigError(PopbertError, ValueError):
    """An invalid configuration file, preset name, `--set` override or tracking setting."""


class CheckpointError(PopbertError):
    """A checkpoint directory that is missing, incomplete or does not match the run's config."""


class WriteError(PopbertError):
    """An output that could not be written for want of room or rights (a full disk, a quota, a
    read-only filesystem): the run's fault-free state on disk is kept, so freeing space and
    resuming goes on where it stopped."""


class InputError(PopbertError, ValueError):
    """A batch a session cannot run: a graph input missing, of the wrong shape, or holding an
    id outside the table it indexes (a token id beyond the vocabulary)."""


class FileError(PopbertError, ValueError):
    """A file that is not what its reader needs: missing, unreadable, not UTF-8 text, not the
    format it should hold (`popbert.textfile` says so in one line)."""


class UsageError(PopbertError):
    """A command-line or API call that cannot be honoured as given (e.g. nothing to plot)."""


def one_line(error: BaseException, limit: int | None = None) -> str:
    """``error``'s message on one line (whitespace runs collapsed), cut to ``limit`` characters;
    its type's name when the message is empty. For quoting a library's error in ours."""
    text = " ".join(str(error).split())[:limit]
    return text or type(error).__name__


__all__ = ["CheckpointError", "ConfigError", "InputError", "PopbertError", "UsageError",
           "WriteError", "one_line"]
