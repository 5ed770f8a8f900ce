"""A throwaway PostgreSQL server for the tests that need a real multi-client study store.

The `postgres_url` fixture runs `initdb` (trust auth) in a fresh temporary directory, starts the
server with `pg_ctl` on a free localhost port (its unix socket in the same directory, so nothing
is shared with a system server), creates a database and yields a SQLAlchemy URL that Optuna's
`RDBStorage` takes; teardown stops the server and removes the directory.

The server binaries come from PATH or Debian's `/usr/lib/postgresql/<version>/bin` (the
`postgresql` package, which `.ci/run` installs when it is missing); without them the tests that
use the fixture are skipped with the reason. PostgreSQL refuses to run as root, so under root the
server commands run as the `postgres` user (else `nobody`) through `runuser`.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DATABASE = "popbert_test"
SUPERUSER = "postgres"


def find_bindir() -> Path | None:
    """The directory holding initdb, pg_ctl and createdb: PATH first, then Debian's versioned
    directories (newest version first), which are not on PATH by default."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        bindir = Path(os.path.realpath(on_path)).parent
        if (bindir / "pg_ctl").exists():
            return bindir
    candidates = glob.glob("/usr/lib/postgresql/*/bin")

    def version(path: str) -> tuple[int, ...]:
        name = Path(path).parent.name
        return tuple(int(p) for p in name.split(".") if p.isdigit())

    for bindir in sorted(candidates, key=version, reverse=True):
        if all((Path(bindir) / tool).exists() for tool in ("initdb", "pg_ctl", "createdb")):
            return Path(bindir)
    return None


def _server_user() -> str | None:
    """The user the server runs as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """One PostgreSQL cluster in `root`, started on `port`; `url` is its SQLAlchemy URL."""

    def __init__(self, bindir: Path, root: Path, run_as: str | None) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.run_as = run_as
        self.port = 0

    def _server_cmd(self, *args: str) -> list[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        return ["runuser", "-u", self.run_as, "--", *cmd] if self.run_as else cmd

    def _run(self, cmd: list[str], what: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{what} failed ({done.returncode}): {done.stderr.strip()}\n{log}")

    def start(self) -> None:
        if self.run_as:
            # The server user must own the cluster directory (initdb checks it).
            user = pwd.getpwnam(self.run_as)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run(self._server_cmd("initdb", "-D", str(self.data), "-A", "trust", "-U",
                                   SUPERUSER, "-E", "UTF8", "--no-sync", "--no-instructions"),
                  "initdb")
        for attempt in range(5):  # the free port can be taken between probe and start
            self.port = _free_port()
            options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                       "-c fsync=off -c max_connections=50")
            done = subprocess.run(self._server_cmd("pg_ctl", "-D", str(self.data), "-l",
                                                   str(self.log), "-o", options, "-w", "-t",
                                                   "60", "start"),
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                break
            if attempt == 4:
                log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"pg_ctl start failed: {done.stderr.strip()}\n{log}")
            time.sleep(0.2)
        # Clients need no special user: trust auth on localhost.
        self._run([str(self.bindir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port),
                   "-U", SUPERUSER, DATABASE], "createdb")

    def stop(self) -> None:
        if self.data.is_dir():
            subprocess.run(self._server_cmd("pg_ctl", "-D", str(self.data), "-m", "fast",
                                            "-w", "stop"),
                           capture_output=True, timeout=120, check=False)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://{SUPERUSER}@127.0.0.1:{self.port}/{DATABASE}"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """SQLAlchemy URL of a PostgreSQL server private to this test session (skips when the
    server binaries or psycopg2 are missing)."""
    pytest.importorskip("psycopg2", reason="psycopg2 (pip install psycopg2-binary) is needed "
                                           "to talk to PostgreSQL")
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or in "
                    "/usr/lib/postgresql/*/bin: apt-get install postgresql (.ci/run does)")
    run_as = _server_user()
    if os.geteuid() == 0 and (run_as is None or shutil.which("runuser") is None):
        pytest.skip("running as root, and PostgreSQL refuses root: no postgres/nobody user "
                    "or no runuser to start it as another user")
    # Not pytest's tmp_path: its parents are private to our user, and under root the server
    # runs as another user that must reach its directory. mkdtemp makes it mode 0700.
    root = Path(tempfile.mkdtemp(prefix="popbert-pg-"))
    server = PostgresServer(bindir, root, run_as)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


__all__ = ["PostgresServer", "find_bindir", "postgres_url"]
