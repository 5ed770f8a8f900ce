"""A real S3-compatible server on 127.0.0.1 for the object-storage tests and benchmarks: moto's
server mode in a process of its own, with credentials enforced (an IAM user and its access key,
made through moto's IAM API), and `Relay`, a TCP relay in front of it that can drop every
connection once a given number of bytes has gone through and refuse new ones for a while (the
server stopping mid-transfer and coming back), and can cap the bandwidth (a remote store's link
instead of the loopback's).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from replica_helpers import free_port

REGION = "us-east-1"
# Requests moto serves before it checks credentials: enough to create the user and its key.
SETUP_REQUESTS = 3


@dataclass
class S3Server:
    endpoint: str
    key_id: str
    secret: str
    process: subprocess.Popen

    def environment(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS variables a client (popbert, boto3, s3fs) reads."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(key=self.key_id, secret=self.secret, skip_instance_cache=True,
                                 endpoint_url=self.endpoint)


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server with credentials enforced, stopped (and its process gone) afterwards."""
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_REQUESTS)}
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                str(port)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        import boto3

        iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION,
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="popbert")
        policy = {"Version": "2012-10-17",
                  "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="popbert", PolicyName="s3",
                            PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="popbert")["AccessKey"]
        yield S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], process)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Relay:
    """A TCP relay from 127.0.0.1:`port` to `target_port`.

    `drop_after`: once that many bytes have come back from the server (over all connections),
    every open connection is cut and the listening socket closed for `down_s` seconds
    (connections refused), then it listens again; once only, and `dropped` tells whether it
    happened. `bytes_per_s`: the server's replies share a link of that bandwidth."""

    def __init__(self, target_port: int, drop_after: int | None = None, down_s: float = 1.5,
                 bytes_per_s: float | None = None):
        self.target_port = target_port
        self.drop_after = drop_after
        self.down_s = down_s
        self.bytes_per_s = bytes_per_s
        self.port = free_port()
        self.relayed = 0
        self.dropped = threading.Event()
        self._link_free_at = time.monotonic()  # when the capped link has sent what it holds
        self._sockets: list[socket.socket] = []
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._listener = self._listen()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        return listener

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed: down, or stopped
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._guard:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(65536):
                if counted and self.bytes_per_s:
                    with self._guard:
                        start = max(self._link_free_at, time.monotonic())
                        self._link_free_at = start + len(data) / self.bytes_per_s
                    time.sleep(max(0.0, self._link_free_at - time.monotonic()))
                sink.sendall(data)
                if counted and self.drop_after is not None:
                    with self._guard:
                        self.relayed += len(data)
                        due = self.relayed >= self.drop_after and not self.dropped.is_set()
                        if due:
                            self.dropped.set()
                    if due:
                        self._go_down()
                        return
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.close()
                except OSError:
                    pass

    def _go_down(self) -> None:
        with self._guard:
            doomed, self._sockets = self._sockets, []
        self._listener.close()
        for s in doomed:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        time.sleep(self.down_s)
        self._listener = self._listen()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._guard:
            for s in self._sockets:
                try:
                    s.close()
                except OSError:
                    pass
