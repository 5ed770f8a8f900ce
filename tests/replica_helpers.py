"""Helpers of the multi-process tests: a rendezvous for gloo, a free TCP port for servers, and
comparing trained weights.

"Relative" is ||a - b|| / ||b|| over all weights (see tests/distributed/test_distributed.py for
why the per-tensor bound is 100x the model-wide one).
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(directory: Path) -> str:
    """An `init_method` for spawned gloo replicas: a file store in `directory` (which must not
    hold one yet). A file cannot be taken by another process between choosing it and binding
    it, as a port from `free_port` can on a busy machine."""
    store = Path(directory) / "rendezvous"
    assert not store.exists(), store
    return f"file://{store}"


def relative(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float]:
    """(||a - b|| / ||b|| over all weights, worst per-tensor max|a - b| / max|b|)."""
    assert a.keys() == b.keys()
    diff = np.sqrt(sum(float(((a[k] - b[k]).astype(np.float64) ** 2).sum()) for k in a))
    norm = np.sqrt(sum(float((b[k].astype(np.float64) ** 2).sum()) for k in b))
    worst = max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-30)) for k in a)
    return diff / norm, worst


def assert_same(a: dict, b: dict, tolerance: float, what: str) -> None:
    model, worst = relative(a, b)
    print(f"{what}: relative {model:.2e}, worst tensor {worst:.2e}")
    assert model <= tolerance, (what, model)
    assert worst <= 100 * tolerance, (what, worst)
    assert model > 0 or worst == 0  # the comparison sees real numbers
