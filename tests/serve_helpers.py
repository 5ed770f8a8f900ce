"""A real `popbert serve` process on 127.0.0.1 for the server tests: started on a free port,
waited for until `/health` answers, stopped with SIGTERM (killed only if it hangs), its log kept
for the assertions."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m popbert serve --model MODEL ARGS...` with its output in `log_path`."""

    def __init__(self, model: Path, *args: str, log_path: Path, env: dict[str, str] | None = None,
                 scheme: str = "http", verify: ssl.SSLContext | bool = False) -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.verify = verify
        self.command = [sys.executable, "-m", "popbert", "serve", "--model", str(model),
                        "--port", str(self.port), "--threads", "1", *args]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=self.env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"popbert serve exited {self.process.returncode}:\n"
                                   + self.log_path.read_text())
            try:
                if httpx.get(f"{self.url}/health", verify=self.verify, timeout=2).status_code \
                        == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("popbert serve did not become healthy:\n" + self.log_path.read_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the server; its exit status (killed, and -9, if it does not stop)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode

    def __exit__(self, *_: object) -> None:
        self.stop()

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, verify=self.verify, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of `/metrics`, read with prometheus-client's own parser (0 if absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        headers = kwargs_headers(self.env)
        text = httpx.get(f"{self.url}/metrics", verify=self.verify, headers=headers,
                         timeout=30).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    total += sample.value
        return total


def kwargs_headers(env: dict[str, str]) -> dict[str, str]:
    key = env.get("POPBERT_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class SlowClient:
    """A request whose body arrives in two parts: between them the server counts it in flight
    but has none of its rows, so the batcher holds the batches it could join (up to
    `--max-wait-ms`): a deterministic way to have requests wait inside the server."""

    def __init__(self, server: Server, route: str, body: dict) -> None:
        import json

        self.payload = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(self.payload)}\r\n\r\n").encode()
        self.sock.sendall(head + self.payload[:5])

    def finish(self) -> int:
        """Send the rest; the response's status."""
        self.sock.sendall(self.payload[5:])
        response = b""
        while b"\r\n" not in response:
            chunk = self.sock.recv(4096)
            if not chunk:
                break
            response += chunk
        self.sock.close()
        return int(response.split(b" ", 2)[1])

    def unfinished(self) -> tuple[int, dict]:
        """Send nothing more; the status and JSON body the server answers with, read until it
        closes the connection."""
        response = b""
        while chunk := self.sock.recv(4096):
            response += chunk
        self.sock.close()
        head, _, body = response.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), json.loads(body)


def _random_value(rng: np.random.Generator, depth: int = 0):
    """A JSON value of any kind a client might send where another was expected."""
    kinds = ["null", "bool", "int", "float", "text", "list", "object"]
    kind = kinds[rng.integers(len(kinds) if depth < 2 else 5)]
    if kind == "null":
        return None
    if kind == "bool":
        return bool(rng.integers(2))
    if kind == "int":
        return int(rng.choice([0, 1, -1, 2, 30521, 30522, 10 ** 12, -(10 ** 12), 10 ** 30]))
    if kind == "float":
        return float(rng.choice([0.0, 0.5, -1.5, 1e308, float("nan"), float("inf")]))
    if kind == "text":
        return str(rng.choice(["", " ", "x", "word " * 300, "\u0000", "\u200b\u200b", "é🙂",
                               "\ud7ff", "[CLS]", "search_query: ", "\n\t"]))
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    return {str(rng.choice(["input", "inputs", "model", "x"])): _random_value(rng, depth + 1)}


def _typed_value(rng: np.random.Generator, kind: str):
    """A value of the kind a field takes, at its edges: odd texts, token ids out of range,
    empty lists, zero and huge sizes."""
    def text():
        if rng.random() < 0.2:
            return _random_value(rng, 2)
        return str(rng.choice(["", " ", "x", "a b", "word " * 300, "\u0000", "\u200b", "é🙂",
                               "[SEP] [PAD]", "\n", "half a pair \ud800"]))

    def ids():
        return [int(rng.choice([0, 101, 102, 30521, 30522, -1, 10 ** 12]))
                for _ in range(int(rng.integers(0, 4)))]

    if kind == "texts":
        shape = rng.integers(5)
        if shape == 0:
            return text()
        if shape == 1:
            return [text() for _ in range(int(rng.integers(0, 4)))]
        if shape == 2:
            return [[text(), text()] for _ in range(int(rng.integers(0, 3)))]
        if shape == 3:
            return [{"question": text(), "context": text()}]
        return ids() if rng.random() < 0.5 else [ids() for _ in range(int(rng.integers(0, 3)))]
    if kind == "text":
        return text()
    if kind == "similarity":
        return {"source_sentence": text(), "sentences": [text() for _ in range(
            int(rng.integers(0, 3)))]}
    if kind == "parameters":
        return {"truncate": bool(rng.integers(2)),
                "truncation_direction": str(rng.choice(["Left", "Right", "up"]))}
    if kind == "ids":
        return ids() if rng.random() < 0.5 else [ids() for _ in range(int(rng.integers(0, 3)))]
    if kind == "documents":
        return [text() if rng.random() < 0.7 else {"text": text()}
                for _ in range(int(rng.integers(0, 4)))]
    if kind == "size":
        return int(rng.choice([0, 1, 8, 384, 385, -3, 10 ** 9]))
    if kind == "direction":
        return str(rng.choice(["Left", "Right", "left", "LEFT", ""]))
    if kind == "format":
        return str(rng.choice(["float", "base64", "FLOAT", ""]))
    if kind == "model":
        return str(rng.choice(["minilm", "minilm", "other", "", "mini\udfffl"]))
    return bool(rng.integers(2))


#: Every body field of every route, with the kind of value it takes.
ROUTE_FIELDS = {"/v1/embeddings": {"input": "texts", "model": "model",
                                   "encoding_format": "format", "dimensions": "size",
                                   "truncate": "bool", "user": "text"},
                "/embed": {"inputs": "texts", "normalize": "bool", "truncate": "bool",
                           "prompt_name": "text", "dimensions": "size",
                           "truncation_direction": "direction"},
                "/embed_all": {"inputs": "texts", "truncate": "bool", "prompt_name": "text",
                               "truncation_direction": "direction"},
                "/similarity": {"inputs": "similarity", "parameters": "parameters"},
                "/score": {"text_1": "texts", "text_2": "texts", "model": "model",
                           "use_activation": "bool"},
                "/classify": {"input": "texts", "model": "model"},
                "/tokenize": {"inputs": "texts", "add_special_tokens": "bool",
                              "prompt_name": "text"},
                "/decode": {"ids": "ids", "skip_special_tokens": "bool"},
                "/predict": {"inputs": "texts", "raw_scores": "bool", "truncate": "bool",
                             "truncation_direction": "direction"},
                "/rerank": {"query": "text", "texts": "texts", "raw_scores": "bool",
                            "return_text": "bool", "truncate": "bool",
                            "truncation_direction": "direction"},
                "/v1/rerank": {"query": "text", "documents": "documents", "model": "model",
                               "top_n": "size", "return_documents": "bool"},
                "/v2/rerank": {"query": "text", "documents": "documents", "model": "model",
                               "top_n": "size", "max_tokens_per_doc": "size"}}
REQUIRED = ("input", "inputs", "model", "query", "texts", "documents", "ids", "text_1",
            "text_2")


def requests_of_every_kind(client: httpx.Client, count: int, seed: int) -> dict[int, int]:
    """`count` seeded requests over every route: each field mostly of its own kind at its
    edges (odd texts, token ids out of the vocabulary, empty lists, sizes of 0 or 10^9),
    sometimes of any JSON kind, and sometimes the body itself not an object. Asserts every
    answer is a 2xx or a 4xx with an error body; returns the count of each status."""
    rng = np.random.default_rng(seed)
    statuses: dict[int, int] = {}
    for index in range(count):
        route = list(ROUTE_FIELDS)[index % len(ROUTE_FIELDS)]
        if rng.random() < 0.05:
            body = _random_value(rng)  # not an object at all
        else:
            body = {name: (_typed_value(rng, kind) if rng.random() < 0.85
                           else _random_value(rng))
                    for name, kind in ROUTE_FIELDS[route].items()
                    if name in REQUIRED or rng.random() < 0.3}
        content = json.dumps(body, allow_nan=True).encode()
        response = client.post(route, content=content,
                               headers={"content-type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (route, body, response.text)
        assert response.status_code == 200 or "error" in response.json(), (route, body)
    return statuses
