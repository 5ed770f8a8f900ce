"""`popbert serve`'s Prometheus metrics (prometheus-client): requests by route and status,
their latency, the batches the batcher ran (rows, tokens, padding, time), the rows waiting,
the requests in flight, the tokens served and the clients given up on for stalling.

With several workers (`--workers N`) every process writes its samples to a shared directory
(prometheus-client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`, set by
`popbert.serve.server`), and `/metrics` from any of them sums the whole server.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


class ServeMetrics:
    """The server's metrics in a registry of its own (an app made twice in one process, as
    tests do, does not collide)."""

    def __init__(self, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess and bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        registry = None if self.multiprocess else CollectorRegistry()
        extra = {"registry": registry}
        self.registry = registry
        self._requests = Counter("popbert_requests", "HTTP requests by route and status",
                                 ("route", "status"), **extra)
        self._latency = Histogram("popbert_request_duration_seconds",
                                  "Time from request to response, by route", ("route",),
                                  buckets=LATENCY_BUCKETS, **extra)
        self._batch_rows = Histogram("popbert_batch_rows", "Rows in each model run",
                                     buckets=ROW_BUCKETS, **extra)
        self._batch_tokens = Histogram("popbert_batch_tokens",
                                       "Real (unpadded) tokens in each model run",
                                       buckets=TOKEN_BUCKETS, **extra)
        self._batch_seconds = Histogram("popbert_batch_duration_seconds",
                                        "Time of each model run", buckets=LATENCY_BUCKETS,
                                        **extra)
        self._padding = Counter("popbert_padding_tokens",
                                "Token positions computed beyond the rows' own lengths",
                                **extra)
        self._tokens = Counter("popbert_input_tokens", "Tokens fed the model for requests",
                               **extra)
        self._queue_seconds = Histogram("popbert_queue_duration_seconds",
                                        "Time a request's rows waited in the batcher for a "
                                        "model run", buckets=LATENCY_BUCKETS, **extra)
        self._stalled = Counter("popbert_stalled_clients",
                                "Requests given up on after client_timeout_s: the body did "
                                "not arrive (408), or the answer was not taken",
                                ("phase",), **extra)
        mode = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
        self._in_flight = Gauge("popbert_requests_in_flight", "Requests being answered",
                                **mode, **extra)
        self._queue = Gauge("popbert_queue_rows", "Rows waiting for a batch", **mode, **extra)

    def request(self, route: str, status: int, seconds: float) -> None:
        self._requests.labels(route, str(status)).inc()
        self._latency.labels(route).observe(seconds)

    def batch(self, rows: int, tokens: int, computed: int, seconds: float, queued: int) -> None:
        """One model run, and the rows it left waiting."""
        self._batch_rows.observe(rows)
        self._batch_tokens.observe(tokens)
        self._batch_seconds.observe(seconds)
        self._padding.inc(max(0, computed - tokens))
        self._queue.set(queued)

    def tokens(self, count: int) -> None:
        self._tokens.inc(count)

    def queued(self, seconds: float) -> None:
        """How long one request's rows waited for a model run."""
        self._queue_seconds.observe(seconds)

    def stalled(self, phase: str) -> None:
        """A client given up on while sending its `body` or taking its `answer`."""
        self._stalled.labels(phase).inc()

    def in_flight(self, change: int) -> None:
        self._in_flight.inc(change)

    def exposition(self) -> tuple[bytes, str]:
        """The text `/metrics` answers with, and its content type."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServeMetrics"]
