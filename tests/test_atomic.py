"""Atomic files and directories: a failure or a kill never leaves a torn result (popbert.atomic)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from popbert import atomic
from popbert.atomic import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_text,
    remove_tree,
    restore_interrupted,
)
from popbert.errors import PopbertError, WriteError


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((".tmp-", ".old-")))


def test_write_bytes_and_text_replace(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.bin"
    assert atomic_write_bytes(target, b"one") == target
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    atomic_write_text(tmp_path / "t.txt", "héllo\n")
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo\n"
    assert leftovers(target.parent) == [] and leftovers(tmp_path) == []


def test_failed_write_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_file_permissions_follow_umask(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "f.txt", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_directory_created(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    with atomic_directory(final) as tmp:
        assert tmp.name == f".tmp-ckpt-{os.getpid()}" and tmp.parent == tmp_path
        assert not final.exists()
        (tmp / "a.txt").write_text("a")
        (tmp / "nested").mkdir()
        (tmp / "nested" / "b.txt").write_text("b")
    assert (final / "a.txt").read_text() == "a"
    assert (final / "nested" / "b.txt").read_text() == "b"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_directory_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with atomic_directory(final) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert leftovers(tmp_path) == []


def test_exception_keeps_old_directory(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "weights").write_text("v1")
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(final) as tmp:
        (tmp / "weights").write_text("v2-partial")
        raise RuntimeError("boom")
    assert (final / "weights").read_text() == "v1"
    assert sorted(p.name for p in final.iterdir()) == ["weights"]
    assert leftovers(tmp_path) == []


def test_exception_without_old_directory(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), atomic_directory(tmp_path / "ckpt") as tmp:
        (tmp / "x").write_text("x")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_failure_between_renames_restores_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without renameat2: if moving the new directory in fails, the old one comes back."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_replace = os.replace

    def flaky_replace(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        if Path(src).name.startswith(".tmp-"):
            raise OSError("disk gone")
        real_replace(src, dst)

    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "weights").write_text("v1")
    monkeypatch.setattr(atomic.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="disk gone"), atomic_directory(final) as tmp:
        (tmp / "weights").write_text("v2")
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert (final / "weights").read_text() == "v1"
    assert leftovers(tmp_path) == []


def test_restore_interrupted(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    aside = tmp_path / ".old-ckpt-12345"
    aside.mkdir()
    (aside / "weights").write_text("v1")
    assert restore_interrupted(final) is True
    assert (final / "weights").read_text() == "v1" and not aside.exists()
    # With the final directory present, a stale aside copy is just removed.
    aside.mkdir()
    assert restore_interrupted(final) is False
    assert not aside.exists() and (final / "weights").read_text() == "v1"


def test_existing_file_is_not_replaced_by_directory(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    final.write_text("a file")
    with pytest.raises(FileExistsError), atomic_directory(final) as tmp:
        (tmp / "x").write_text("x")
    assert final.read_text() == "a file"
    assert leftovers(tmp_path) == []


WRITER = """
import sys
from pathlib import Path
from popbert.atomic import atomic_directory

final = Path(sys.argv[1])
version = 0
while True:
    version += 1
    with atomic_directory(final) as tmp:
        for i in range(20):
            (tmp / f"part{i}").write_text(f"{version}\\n" * 200)
        (tmp / "DONE").write_text(str(version))
    print(version, flush=True)
"""


def test_kill_during_writes_leaves_a_complete_directory(tmp_path: Path) -> None:
    """SIGKILL a process that rewrites a directory in a loop: what remains is one whole version."""
    final = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(final)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        for _ in range(3):  # wait until a few versions were published
            assert proc.stdout.readline(), "writer died"
        time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    restore_interrupted(final)
    names = sorted(p.name for p in final.iterdir())
    assert names == sorted(["DONE", *(f"part{i}" for i in range(20))])
    version = (final / "DONE").read_text()
    for i in range(20):
        assert (final / f"part{i}").read_text() == f"{version}\n" * 200


# A full disk (issue 20, item 2): one WriteError naming the output, the old content kept, no
# temporary file or directory left behind.


def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file write lands half its bytes, then ENOSPC (as a filling disk does)."""
    create = atomic._create

    def filling(path: Path, data: bytes) -> None:
        create(path, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(atomic, "_create", filling)


def test_a_full_disk_keeps_the_old_file_and_names_it(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "metrics.png"
    target.write_bytes(b"old")
    full_disk(monkeypatch)
    with pytest.raises(WriteError) as raised:
        atomic_write_bytes(target, b"new picture")
    assert str(raised.value) == f"{target}: cannot write: No space left on device"
    assert isinstance(raised.value, PopbertError)
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []


def test_a_full_disk_keeps_the_old_directory_and_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "step-000004"
    final.mkdir()
    (final / "weights").write_text("v1")
    full_disk(monkeypatch)
    with pytest.raises(WriteError, match=f"^{final}: cannot write: No space left on device$"), \
            atomic_directory(final) as tmp:
        atomic.write_file(tmp / "weights", b"v2" * 1000)
    assert (final / "weights").read_text() == "v1" and leftovers(tmp_path) == []


def test_other_write_errors_are_not_disk_errors(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError):
        atomic_write_bytes(tmp_path, b"x")  # a bug or a bad argument keeps its own error


def test_remove_tree_never_leaves_a_torn_directory(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory is renamed to a `.tmp-` name first: a kill while it is deleted leaves no
    step directory with some of its files gone."""
    doomed = tmp_path / "step-000002"
    doomed.mkdir()
    (doomed / "state.json").write_text("{}")
    (doomed / "weights").write_text("w")
    seen = []
    monkeypatch.setattr(atomic.shutil, "rmtree",
                        lambda path, **kw: seen.append(Path(path).name))  # killed: never done
    remove_tree(doomed)
    assert not doomed.exists() and seen == [f".tmp-deleted-step-000002-{os.getpid()}"]
    monkeypatch.undo()
    remove_tree(doomed)  # gone already: nothing to do
    assert leftovers(tmp_path) == [seen[0]]


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(child.stdout)


@pytest.mark.parametrize("kind", ["file", "directory", "staging"])
def test_a_killed_attempts_staging_is_removed_by_the_next(tmp_path: Path, kind: str) -> None:
    """What a SIGKILL leaves beside an output (`.tmp-<name>-<pid>[-<hex>]`) goes when the same
    output is written again; a live writer's staging, and other outputs' names, stay."""
    output = tmp_path / ("model.onnx" if kind == "file" else "model-ir")
    dead, alive = dead_pid(), os.getppid()
    killed = [tmp_path / f".tmp-{output.name}-{dead}-0123abcd",
              tmp_path / f".tmp-{output.name}-{dead}"]
    kept = [tmp_path / f".tmp-{output.name}-{alive}-89abcdef",  # another process, still writing
            tmp_path / f".tmp-{output.name}-2-{dead}-0123abcd",  # another output, `<name>-2`
            tmp_path / f".tmp-{output.name}x-{dead}"]
    for path in killed + kept:
        path.mkdir()
        (path / "half-written").write_bytes(b"\0" * 1024)
    if kind == "file":
        atomic_write_bytes(output, b"whole")
    elif kind == "directory":
        with atomic_directory(output) as tmp:
            (tmp / "model.xml").write_text("<net/>")
    else:
        with atomic.staging_directory(output) as tmp:
            assert tmp.name.startswith(f".tmp-{output.name}-{os.getpid()}-")
    assert not any(p.exists() for p in killed)
    assert all(p.exists() for p in kept)
