"""A real Dask cluster on 127.0.0.1 for tests: a scheduler and workers, each its own process.

Started the way a user starts one (`dask scheduler`, `dask worker`: here their modules, run by
this interpreter so the workers import the popbert under test), workers without a nanny so that
a SIGKILL ends one for good (a nanny would restart it). With `tls` (a CA file, a certificate and
its key, e.g. from `self_signed_certificate`) every connection is TLS and the scheduler accepts
only peers holding a certificate of that CA. Every process is stopped on `close`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def self_signed_certificate(directory: Path) -> tuple[str, str, str]:
    """(CA file, certificate, key): one self-signed certificate for every role, by openssl."""
    cert, key = directory / "dask.pem", directory / "dask.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=dask-internal", "-addext", "subjectAltName=DNS:dask-internal",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(cert), str(key)


def tls_environment(tls: tuple[str, str, str]) -> dict[str, str]:
    """Dask's own settings for a TLS client (what a user exports before `--dask tls://...`)."""
    ca, cert, key = tls
    return {"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": ca,
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": cert,
            "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": key,
            "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True"}


class DaskCluster:
    def __init__(self, directory: Path, tls: tuple[str, str, str] | None = None) -> None:
        self.directory = directory
        self.tls = tls
        directory.mkdir(parents=True, exist_ok=True)
        self.scheduler_file = directory / "scheduler.json"
        self.processes: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
        self.env = env
        self.scheduler = self._start("scheduler", [
            "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
            "--no-dashboard", "--scheduler-file", str(self.scheduler_file),
            *(["--protocol", "tls", *self._tls_args()] if tls else [])])
        deadline = time.monotonic() + 60
        while not self._address() and time.monotonic() < deadline:
            if self.scheduler.poll() is not None:
                raise RuntimeError(f"dask scheduler exited: {self._log('scheduler')}")
            time.sleep(0.1)
        self.address = self._address()
        if not self.address:
            raise RuntimeError(f"dask scheduler did not start: {self._log('scheduler')}")

    def _tls_args(self) -> list[str]:
        if not self.tls:
            return []
        ca, cert, key = self.tls
        return ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]

    def client(self):
        """A `distributed.Client` of this cluster (TLS when it is)."""
        from distributed import Client
        from distributed.security import Security

        if not self.tls:
            return Client(self.address, timeout=30)
        ca, cert, key = self.tls
        return Client(self.address, timeout=30, security=Security(
            tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key, require_encryption=True))

    def _address(self) -> str | None:
        try:
            return json.loads(self.scheduler_file.read_text())["address"]
        except (OSError, ValueError, KeyError):
            return None

    def _log(self, name: str) -> str:
        try:
            return (self.directory / f"{name}.log").read_text()[-2000:]
        except OSError:
            return ""

    def _start(self, name: str, args: list[str], env: dict[str, str | None] | None = None
               ) -> subprocess.Popen:
        """Start `python args...` logging to `<name>.log`; `env` changes the cluster's
        environment for this process (None: the variable removed)."""
        environment = {**self.env, **(env or {})}
        environment = {k: v for k, v in environment.items() if v is not None}
        log = open(self.directory / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                   env=environment, start_new_session=True)
        log.close()
        self.processes.append(process)
        return process

    def add_worker(self, name: str, preload: str | None = None,
                   env: dict[str, str | None] | None = None) -> subprocess.Popen:
        """Start a one-thread worker (with Dask's `--preload` module, if given; `env` changes
        its environment) and wait until the scheduler counts it."""
        process = self._start(name, [
            "-m", "distributed.cli.dask_worker", self.address, "--name", name,
            "--nthreads", "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
            "--local-directory", str(self.directory / name), *self._tls_args(),
            *(["--preload", preload] if preload else [])], env)
        self.workers[name] = process
        self.wait_for_workers(lambda names: name in names, f"worker {name} to join")
        return process

    def worker_address(self, name: str) -> str:
        """The address the scheduler knows the worker `name` by."""
        with self.client() as client:
            return next(a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
                        if w["name"] == name)

    def log(self, name: str) -> str:
        """What the process `name` (a worker, "scheduler") has written so far."""
        return (self.directory / f"{name}.log").read_text()

    def worker_names(self) -> set[str]:
        with self.client() as client:
            return {w["name"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}

    def wait_for_workers(self, condition, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition(self.worker_names()):
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}")

    def kill_worker(self, name: str) -> None:
        """SIGKILL: the worker ends at once, whatever it is running."""
        self.workers[name].send_signal(signal.SIGKILL)
        self.workers[name].wait(timeout=30)

    def close(self) -> None:
        """SIGTERM to all, then SIGKILL to any still running after 3 s in all: a worker
        whose scheduler went first may wait out its reconnect attempts, which a test's
        throw-away cluster does not need."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 3
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
