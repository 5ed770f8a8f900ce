"""`popbert serve`'s threads per worker when `--threads` is not given: the runtime's own
default for one worker on a machine without a CPU limit; otherwise each worker's share of the
CPUs the server may use (`popbert.machine`), so neither workers nor a container's quota are
oversubscribed."""

from __future__ import annotations

import pytest

from popbert.config.sections import ServeConfig
from popbert.serve import server


@pytest.mark.parametrize(("workers", "threads", "quota", "cpus", "expected"), [
    (1, None, None, 64, None),  # the runtime's default: it knows physical from logical cores
    (1, None, 2.0, 2, 2),  # a container limited to 2 CPUs on a 64-core node
    (2, None, None, 2, 1),
    (4, None, None, 16, 4),
    (4, None, 1.5, 2, 1),  # never 0
    (2, 3, None, 16, 3),  # an explicit --threads is kept
])
def test_threads_per_worker(monkeypatch: pytest.MonkeyPatch, workers: int,
                            threads: int | None, quota: float | None, cpus: int,
                            expected: int | None) -> None:
    monkeypatch.setattr(server, "cpu_quota", lambda: quota)
    monkeypatch.setattr(server, "usable_cpus", lambda: cpus)
    config = ServeConfig(workers=workers, threads=threads)
    assert server._threads_shared(config).threads == expected
    assert config.threads == threads  # the caller's config is left as it was
