"""The `prepare-data` stages' work units on a Dask cluster instead of the local process pool.

A stage's units already write their own output part atomically and compute the same bytes
wherever they run, so a cluster only changes who runs them: `on_cluster(address)` connects to a
running Dask scheduler (started by the user: `dask scheduler` / `dask worker`, dask-jobqueue,
Kubernetes) and, inside it, `popbert.data.stages.run_units` submits each unit as a Dask task.
The scheduler reschedules the unit of a worker that dies; the dead worker's temporary file never
matches a part's name, so no half-written part survives. As with Dask's own `Client`, the
connection is the one active in this context (a `ContextVar`), not an argument threaded through
every stage.

Dask and its `distributed` scheduler are an optional extra: `pip install 'popbert[dask]'`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from popbert.data.errors import DataError

__all__ = ["ADDRESS_VARIABLE", "active_cluster", "cluster_slots", "on_cluster",
           "scheduler_address"]

#: Dask's own variable for the scheduler's address (what `dask.config` reads as
#: `scheduler-address`), used when `--dask` is not given.
ADDRESS_VARIABLE = "DASK_SCHEDULER_ADDRESS"
_ACTIVE: ContextVar[Any] = ContextVar("popbert_dask_client", default=None)


def scheduler_address(flag: str | None) -> str | None:
    """The scheduler to use: `--dask`, else $DASK_SCHEDULER_ADDRESS, else None (local pool)."""
    return flag or os.environ.get(ADDRESS_VARIABLE) or None


@contextlib.contextmanager
def on_cluster(address: str, timeout: float | None = None) -> Iterator[Any]:
    """Connect to the Dask scheduler at `address` and run every stage's units there until the
    block ends; yields the `distributed.Client`.

    TLS (`tls://...`) takes its certificates from Dask's own configuration
    (`distributed.comm.tls.*`, e.g. `DASK_DISTRIBUTED__COMM__TLS__CA_FILE`), as `dask worker`
    does. A scheduler that cannot be reached in `timeout` seconds (default: Dask's
    `distributed.comm.timeouts.connect`, 30 s) is a DataError naming it.
    """
    try:
        import distributed
    except ImportError:
        raise DataError("Dask is not installed: pip install 'popbert[dask]' (dask and "
                        "distributed)") from None
    waits = {} if timeout is None else {"timeout": timeout}
    failure = None
    hook = sys.unraisablehook
    # A client that failed to connect still runs its clean-up when it is collected, and that
    # raises into stderr as a traceback: collect it here, with that report silenced.
    sys.unraisablehook = lambda unraisable: None
    try:
        try:
            client = distributed.Client(address, set_as_default=False, **waits)
        except (OSError, TimeoutError, ValueError, TypeError) as exc:
            failure = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if failure is not None:
            gc.collect()
    finally:
        sys.unraisablehook = hook
    if failure is not None:
        raise DataError(f"cannot reach the Dask scheduler at {address}: {failure}")
    token = _ACTIVE.set(client)
    try:
        yield client
    finally:
        _ACTIVE.reset(token)
        client.close()


def active_cluster() -> Any:
    """The `distributed.Client` of the enclosing `on_cluster` block, or None."""
    return _ACTIVE.get()


def cluster_slots(client: Any) -> int:
    """Units the cluster runs at once now: its workers' threads (at least 1, so a cluster
    whose workers have not joined yet still gets work queued for them)."""
    return max(1, sum(client.nthreads().values()))
