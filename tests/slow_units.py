"""A Dask worker preload for tests (`dask worker --preload tests/slow_units.py`): every popbert
work unit on that worker sleeps 3 s before it starts, so a test can find the worker mid-unit
and kill it there, however fast the machine."""

from __future__ import annotations

import time

DELAY_S = 3.0


def dask_setup(worker) -> None:
    from popbert.data import stages

    original = stages._on_worker

    def slow(fn, *job):
        time.sleep(DELAY_S)
        return original(fn, *job)

    # The client sends units by reference to this name; on this worker it now means `slow`.
    stages._on_worker = slow
