"""Crash-safe writes: a kill at any instant leaves either the old file/directory or the new one.

Checkpoints, configs and plots are written to a temporary sibling, fsynced, then renamed into
place. Renames within one directory are atomic on POSIX filesystems, so readers never see a
half-written file under its final name, and a resumed run never loads a torn checkpoint.

A write the filesystem refuses for want of room or rights (a full disk, a quota, a read-only
mount) is one `popbert.errors.WriteError` naming the final path, and what was half-written goes:
the temporary file or directory is removed, the old content stays.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from popbert.errors import WriteError

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# What the filesystem answers when an output cannot be written, whatever popbert does: no room
# (ENOSPC, a quota, a file over the size limit) or no rights (a read-only mount, permissions).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                         errno.EPERM})


def write_error(path: str | os.PathLike[str], error: OSError) -> WriteError:
    """The one line for an output the filesystem refused: the path and the reason."""
    return WriteError(f"{path}: cannot write: {os.strerror(error.errno or 0)}")


@contextlib.contextmanager
def reported(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a write the filesystem refuses (`DISK_ERRNOS`) into a `WriteError` naming `path`
    (the output as the user knows it, not its temporary name); other errors pass unchanged."""
    try:
        yield
    except OSError as error:
        if error.errno in DISK_ERRNOS:
            raise write_error(path, error) from None
        raise


def _fsync_path(path: Path, directory: bool = False) -> None:
    """fsync one file or directory; directories cannot be opened on some platforms (Windows)."""
    flags = os.O_RDONLY
    if directory and hasattr(os, "O_DIRECTORY"):
        flags |= os.O_DIRECTORY
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def clear_leftovers(path: str | os.PathLike[str]) -> list[Path]:
    """Remove what an earlier, killed attempt at writing `path` left beside it: the staging
    names of this module (`.tmp-<name>-<pid>` and `.tmp-<name>-<pid>-<hex>`) whose process is
    gone. A live writer's staging (another process, or this one) is left alone. Returns what
    was removed."""
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        return []
    pattern = re.compile(rf"^\.tmp-{re.escape(path.name)}-(\d+)(?:-[0-9a-f]{{8}})?$")
    removed = []
    for entry in parent.iterdir():
        match = pattern.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        removed.append(entry)
    if removed:
        logger.info("removed %d unfinished earlier write(s) of %s (%s)", len(removed), path,
                    ", ".join(p.name for p in removed))
    return removed


@contextlib.contextmanager
def staging_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A scratch directory beside `path` for building it (`.tmp-<name>-<pid>-<hex>`), removed
    on leaving; one a killed attempt left is removed by the next (`clear_leftovers`)."""
    path = Path(path)
    clear_leftovers(path)
    tmp = _temp_name(path)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, fsynced: how popbert's files reach the
    disk, inside `atomic_directory` or through `atomic_write_bytes`."""
    _create(Path(path), data)


def _create(path: Path, data: bytes) -> None:
    # os.open applies the umask to 0o666, so the file gets the permissions a plain open() would.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` so that `path` holds either its old content or all of `data`; a
    full disk (`DISK_ERRNOS`) is a `WriteError` naming `path`, and the old content stays."""
    path = Path(path)
    tmp = _temp_name(path)
    with reported(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        clear_leftovers(path)
        try:
            _create(tmp, data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_path(path.parent, directory=True)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Text version of `atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode(encoding))


def _fsync_tree(root: Path) -> None:
    """fsync all files, then each directory bottom-up, so renaming `root` publishes durable data"""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = Path(dirpath, name)
            if p.is_file() and not p.is_symlink():
                _fsync_path(p)
        _fsync_path(Path(dirpath), directory=True)


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    """libc's renameat2 (glibc >= 2.28), or None where the platform lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _aside_prefix(final_dir: Path) -> str:
    return f".old-{final_dir.name}-"


def restore_interrupted(final_dir: str | os.PathLike[str]) -> bool:
    """Put back a previous directory left aside by a replace that was killed mid-way.

    Without renameat2 a replace is two renames (old aside, new in); a kill between them leaves
    only `.old-<name>-<pid>`. This renames it back so the previous checkpoint is found again.
    Returns True when something was restored.
    """
    final_dir = Path(final_dir)
    parent = final_dir.parent
    if not parent.is_dir():
        return False
    prefix = _aside_prefix(final_dir)
    asides = sorted(p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir())
    if not asides:
        return False
    if final_dir.exists():
        # The new directory made it in; the aside copy is just garbage from the kill.
        for p in asides:
            shutil.rmtree(p, ignore_errors=True)
        return False
    os.replace(asides[-1], final_dir)
    for p in asides[:-1]:
        shutil.rmtree(p, ignore_errors=True)
    _fsync_path(parent, directory=True)
    logger.warning("restored %s from an interrupted replace", final_dir)
    return True


@contextlib.contextmanager
def atomic_directory(final_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary sibling directory; on success it replaces `final_dir` atomically.

    On an exception the temporary directory is removed and `final_dir` is left untouched (a
    full disk, `DISK_ERRNOS`: a `WriteError` naming `final_dir`). An existing `final_dir` is
    swapped out atomically where the OS allows (Linux renameat2), else renamed aside, replaced,
    then deleted (see `restore_interrupted`).
    """
    final_dir = Path(final_dir)
    parent = final_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    restore_interrupted(final_dir)
    clear_leftovers(final_dir)
    if final_dir.exists() and not final_dir.is_dir():  # before any byte is written
        raise FileExistsError(errno.EEXIST, "a file is in the way of this directory",
                              str(final_dir))
    tmp = parent / f".tmp-{final_dir.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if final_dir.exists() and final_dir.is_dir():
            if _exchange(tmp, final_dir):
                # `tmp` now holds the previous content.
                _fsync_path(parent, directory=True)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                aside = parent / f"{_aside_prefix(final_dir)}{os.getpid()}"
                if aside.exists():
                    shutil.rmtree(aside)
                os.replace(final_dir, aside)
                os.replace(tmp, final_dir)
                _fsync_path(parent, directory=True)
                shutil.rmtree(aside, ignore_errors=True)
        else:
            if final_dir.exists():
                raise FileExistsError(errno.EEXIST, "a file is in the way of this directory",
                                      str(final_dir))
            os.replace(tmp, final_dir)
            _fsync_path(parent, directory=True)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            restore_interrupted(final_dir)
        if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
            raise write_error(final_dir, error) from None
        raise


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete a directory so that a kill at any instant leaves it whole or gone, never a torn
    checkpoint: renamed to a temporary `.tmp-` sibling first (what a kill leaves there is
    tidied like any unfinished write), then deleted."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(f".tmp-deleted-{path.name}-{os.getpid()}")
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    _fsync_path(path.parent, directory=True)
    shutil.rmtree(doomed, ignore_errors=True)


__all__ = ["DISK_ERRNOS", "atomic_directory", "atomic_write_bytes", "atomic_write_text",
           "clear_leftovers", "remove_tree", "reported", "restore_interrupted",
           "staging_directory", "write_error", "write_file"]
