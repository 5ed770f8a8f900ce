"""A real Dask cluster on 127.0.0.1 for tests: a scheduler and workers, each its own process.

Started the way a user starts one (`dask scheduler`, `dask worker`: here their modules, run by
this interpreter so the workers import the popbert under test), workers without a nanny so that
a SIGKILL ends one for good (a nanny would restart it). Every process is stopped on `close`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class DaskCluster:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.scheduler_file = directory / "scheduler.json"
        self.processes: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
        self.env = env
        self.scheduler = self._start("scheduler", [
            "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
            "--no-dashboard", "--scheduler-file", str(self.scheduler_file)])
        deadline = time.monotonic() + 60
        while not self._address() and time.monotonic() < deadline:
            if self.scheduler.poll() is not None:
                raise RuntimeError(f"dask scheduler exited: {self._log('scheduler')}")
            time.sleep(0.1)
        self.address = self._address()
        if not self.address:
            raise RuntimeError(f"dask scheduler did not start: {self._log('scheduler')}")

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

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.directory / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                   env=self.env, start_new_session=True)
        log.close()
        self.processes.append(process)
        return process

    def add_worker(self, name: str, preload: str | None = None) -> subprocess.Popen:
        """Start a one-thread worker (with Dask's `--preload` module, if given) and wait until
        the scheduler counts it."""
        process = self._start(name, [
            "-m", "distributed.cli.dask_worker", self.address, "--name", name,
            "--nthreads", "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
            "--local-directory", str(self.directory / name),
            *(["--preload", preload] if preload else [])])
        self.workers[name] = process
        self.wait_for_workers(lambda names: name in names, f"worker {name} to join")
        return process

    def worker_names(self) -> set[str]:
        from distributed import Client

        with Client(self.address, timeout=30) as client:
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
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
