"""A directory's exclusive lock: `.lock`, held with `flock` while one process uses the directory.

A run directory (`popbert.io.run_dir`) and a `prepare-data` stage directory
(`popbert.data.stages`) each belong to one process at a time; a second one stops with one line
naming the first (`held by pid 1234 on host X since 14:02`) instead of interleaving its writes.
The lock is the kernel's, on an open file, so it goes when its holder closes it or dies (even by
SIGKILL): a crash never leaves a directory locked. A leaf module (errors only), so every layer
may lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import sys
import time
import weakref
from pathlib import Path

from popbert.errors import UsageError

try:
    import fcntl
except ImportError:  # not POSIX (Windows): nothing is locked
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class DirectoryLock:
    """An exclusive `flock` on `<directory>/.lock`, held while one process uses the directory.

    The lock is the kernel's, on an open file: it goes when the holder closes it or dies (even
    by SIGKILL), so a crash never leaves a directory locked. The file says who holds it (host,
    pid, start time, command) for the message another process gets; it appears with its
    content in one `link`, so a reader never sees half of it. A file whose holder died is
    stale: the next process removes it (while holding its lock) and makes its own.
    `release()` (or leaving the `with` block) unlocks and removes the file; it is idempotent.
    """

    def __init__(self, directory: Path, fd: int | None, holder: dict | None = None):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._fd = fd
        self._pid = os.getpid()  # a forked child's copy must not remove its parent's lock
        self.holder = holder or {}
        if fd is not None:
            _HELD.add(self)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock and remove the lock file (only if it is still this lock's own)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        try:
            if os.getpid() == self._pid and _same_file(fd, self.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)  # while locked: nobody can be about to take it
        finally:
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a lock dropped without release() still lets the directory go
        with contextlib.suppress(Exception):
            self.release()


# Locks held by this process. A forked child (a data worker) closes its copies at once: the
# parent's lock is untouched (flock holds while any copy is open), and a child outliving a
# killed parent does not keep the directory locked.
_HELD: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:  # EWOULDBLOCK is EAGAIN; anything else is a real failure
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "command": " ".join(sys.argv)[:500]}


def describe_holder(holder: dict) -> str:
    """`pid 1234 on host X since 14:02` (a date too when not today) from a lock file's record."""
    parts = []
    if "pid" in holder:
        parts.append(f"pid {holder['pid']}")
    if "host" in holder:
        parts.append(f"on host {holder['host']}")
    started = holder.get("started")
    if isinstance(started, int | float):
        when = time.localtime(started)
        today = time.localtime()
        fmt = "%H:%M" if when[:3] == today[:3] else "%Y-%m-%d %H:%M"
        parts.append(f"since {time.strftime(fmt, when)}")
    return " ".join(parts) or "another process"


def _read_holder(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 65536, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _open_new(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)


def _create_lock(path: Path, holder: bytes) -> int | None:
    """Make `path` a new lock file holding `holder`, locked; None if another process made one
    first. The content is written to a temporary file, locked, then linked into place."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    fd = _open_new(tmp)
    linked = False
    try:
        os.write(fd, holder)
        os.fsync(fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file nobody else knows yet
        try:
            os.link(tmp, path)
            linked = True
        except (FileExistsError, FileNotFoundError):  # another's lock, or our file cleared
            return None
        except OSError as error:  # no hard links (some network filesystems): create in place
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                                   errno.EMLINK):
                raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not linked:
            os.close(fd)
    return fd if linked else _create_lock_in_place(path, holder)


def _create_lock_in_place(path: Path, holder: bytes) -> int | None:
    """`_create_lock` without hard links: the file is made empty, then locked and written (a
    reader may find it empty for an instant, and then names no holder)."""
    try:
        fd = _open_new(path)
    except FileExistsError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, holder)
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        raise
    return fd


# flock's answers on filesystems without locks (Lustre mounted without -o flock, some FUSE).
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def lock_directory(directory: Path) -> DirectoryLock:
    """Take `directory`'s lock (the directory must exist), or fail with one line naming the
    process that holds it. Where `fcntl` does not exist (Windows), or the filesystem has no
    locks, nothing is locked (with a warning for the latter)."""
    directory = Path(directory)
    if fcntl is None:
        log.debug("no fcntl: %s is not locked", directory)
        return DirectoryLock(directory, None)
    try:
        return _lock(directory)
    except OSError as error:
        if error.errno not in _NO_LOCKS:
            raise
        log.warning("%s: not locked, its filesystem has no file locks (%s); make sure no "
                    "other process uses it", directory, os.strerror(error.errno))
        return DirectoryLock(directory, None)


def _lock(directory: Path) -> DirectoryLock:
    path = directory / LOCK_FILE
    record = _holder_record()
    content = (json.dumps(record) + "\n").encode()
    empty_turns = 0
    for _ in range(100):  # each turn is a race lost to a process taking or dropping the lock
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            try:
                fd = _create_lock(path, content)
            except FileNotFoundError:
                fd = None
                if not directory.is_dir():
                    raise UsageError(f"{directory}: removed while its lock was being "
                                     "taken") from None
            if fd is not None:
                return DirectoryLock(directory, fd, record)
            continue
        try:
            if not _try_flock(fd):
                holder = _read_holder(fd)
                raise UsageError(f"{directory}: in use by another popbert process (its "
                                 f"{LOCK_FILE} is held by {describe_holder(holder)}); wait "
                                 "for it to end, or use another directory")
            if _same_file(fd, path):
                # Locked by nobody: its holder died. Remove it while holding it, then make ours.
                stale = _read_holder(fd)
                if not stale and empty_turns < 20:  # made in place, not locked yet: wait
                    empty_turns += 1
                    time.sleep(0.05)
                    continue
                os.unlink(path)
                log.info("%s: removed the lock of a process that ended without releasing it "
                         "(%s)",
                         directory, describe_holder(stale))
        finally:
            os.close(fd)
    raise UsageError(f"{directory}: could not take its lock {path} (other processes "
                     "keep taking and releasing it)")


__all__ = ["LOCK_FILE", "DirectoryLock", "describe_holder", "lock_directory"]
