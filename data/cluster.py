"""The `prepare-data` stages' work units on a Dask cluster instead of the local process pool.

A stage's units already write their own output part atomically and compute the same bytes
wherever they run, so a cluster only changes who runs them: `on_cluster(address)` connects to a
running Dask scheduler (started by the user: `dask scheduler` / `dask worker`, dask-jobqueue,
Kubernetes) and, inside it, `popbert.data.stages.run_units` submits each unit as a Dask task.
The scheduler reschedules the unit of a worker that dies; the dead worker's temporary file never
matches a part's name, so no half-written part survives. As with Dask's own `Client`, the
connection is the one active in this context (a `ContextVar`), not an argument threaded through
every stage.

Nothing waits in silence: before the first unit `on_cluster` waits (at most `wait` seconds,
`--dask-wait`) for a worker to join, and checks on every worker that it can import popbert's
stages and the packages they need and reach the output (`check_workers`); while units run,
`run_units` says how many workers are connected and how many units are done, and a cluster
left without any worker for `wait` seconds ends the stage in one line.

Dask and its `distributed` scheduler are an optional extra: `pip install 'popbert[dask]'`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from popbert.data import storage
from popbert.data.errors import DataError
from popbert.errors import one_line

__all__ = ["ADDRESS_VARIABLE", "DEFAULT_WAIT_S", "WORKER_MODULES", "active_cluster",
           "check_workers", "cluster_slots", "cluster_wait", "on_cluster", "scheduler_address",
           "worker_count"]

log = logging.getLogger(__name__)

#: Dask's own variable for the scheduler's address (what `dask.config` reads as
#: `scheduler-address`), used when `--dask` is not given.
ADDRESS_VARIABLE = "DASK_SCHEDULER_ADDRESS"
_ACTIVE: ContextVar[Any] = ContextVar("popbert_dask_client", default=None)
#: Seconds a stage waits for a worker (to join at the start, or after all have left) before it
#: ends in one line: long enough for a batch system to start a worker, short enough that a
#: cluster with none is noticed within minutes. `--dask-wait` sets it.
DEFAULT_WAIT_S = 120.0
_WAIT: ContextVar[float] = ContextVar("popbert_dask_wait", default=DEFAULT_WAIT_S)
#: What every worker imports to run the stages' units: the stages and the packages their units
#: load (HDF5, the tokenizers). A stage adds its own (`on_cluster`'s `modules`: wikiextractor
#: for `extract`, the sentence splitter, pyarrow for Parquet).
WORKER_MODULES = ("popbert.data", "popbert.data.prepare", "popbert.data.sentences",
                  "popbert.data.wikipedia", "h5py", "numpy", "tokenizers")


def scheduler_address(flag: str | None) -> str | None:
    """The scheduler to use: `--dask`, else $DASK_SCHEDULER_ADDRESS, else None (local pool)."""
    return flag or os.environ.get(ADDRESS_VARIABLE) or None


@contextlib.contextmanager
def on_cluster(address: str, timeout: float | None = None, wait: float = DEFAULT_WAIT_S,
               output: str | os.PathLike | None = None,
               modules: tuple[str, ...] = ()) -> Iterator[Any]:
    """Connect to the Dask scheduler at `address` and run every stage's units there until the
    block ends; yields the `distributed.Client`.

    TLS (`tls://...`) takes its certificates from Dask's own configuration
    (`distributed.comm.tls.*`, e.g. `DASK_DISTRIBUTED__COMM__TLS__CA_FILE`), as `dask worker`
    does. A scheduler that cannot be reached in `timeout` seconds (default: Dask's
    `distributed.comm.timeouts.connect`, 30 s) is a DataError naming it; so is a cluster
    without a worker after `wait` seconds, or one whose workers cannot import
    `WORKER_MODULES` and `modules` or reach `output` (`check_workers`).
    """
    if not wait > 0:
        raise DataError(f"the wait for Dask workers must be > 0 seconds, got {wait}")
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
    try:
        check_workers(client, wait, output, modules)
    except BaseException:
        client.close()
        raise
    token = _ACTIVE.set(client)
    waited = _WAIT.set(wait)
    quiet = _NoTracebacks()
    loggers = [logging.getLogger(name) for name in _DASK_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield client
    finally:
        _WAIT.reset(waited)
        _ACTIVE.reset(token)
        with contextlib.suppress(Exception):  # a scheduler already gone: nothing to close
            client.close()
        for logger in loggers:
            logger.removeFilter(quiet)


#: Dask's loggers that report a lost scheduler with a traceback (the client's reconnection);
#: the stage says it in one line instead (`popbert.data.stages`).
_DASK_LOGGERS = ("distributed.client", "distributed.core", "distributed.comm.core")


class _NoTracebacks(logging.Filter):
    """Dask's own reports while a stage runs, without their tracebacks: one line each, or
    nothing for a report that was only a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.exc_text:
            record.exc_info = None
            record.exc_text = None
            return bool(record.getMessage().strip())
        return True


def active_cluster() -> Any:
    """The `distributed.Client` of the enclosing `on_cluster` block, or None."""
    return _ACTIVE.get()


def cluster_wait() -> float:
    """Seconds the enclosing `on_cluster` block waits for a worker before it gives up."""
    return _WAIT.get()


def cluster_slots(client: Any) -> int:
    """Units the cluster runs at once now: its workers' threads (at least 1, so a cluster
    whose workers have not joined yet still gets work queued for them); losing the scheduler
    is a DataError."""
    return max(1, sum(_threads_by_worker(client).values()))


def worker_count(client: Any) -> int:
    """Workers connected to the scheduler now; losing the scheduler is a DataError."""
    return len(_threads_by_worker(client))


def _threads_by_worker(client: Any) -> dict[str, int]:
    """The scheduler's answer to "which workers, with how many threads": every question a
    stage asks the scheduler goes through here, so a scheduler lost at any of them is the
    same one DataError line, never Dask's traceback."""
    try:
        return client.nthreads()
    except Exception as exc:  # the connection to the scheduler is gone
        raise DataError(f"lost the Dask scheduler at {client.scheduler.address} "
                        f"({one_line(exc, 200)})") from None


def check_workers(client: Any, wait: float = DEFAULT_WAIT_S,
                  output: str | os.PathLike | None = None, modules: tuple[str, ...] = ()
                  ) -> None:
    """Before the first unit: wait at most `wait` seconds for a worker, then check on every
    worker that it imports `WORKER_MODULES` and `modules` and can write `output` (a URL: its
    bucket answers with the worker's own credentials; a local path: the worker sees its
    nearest existing directory and may write there). A failure is one DataError naming the
    worker."""
    address = client.scheduler.address
    if not worker_count(client):
        log.info("waiting up to %g s for a Dask worker to join the scheduler at %s "
                 "(--dask-wait)", wait, address)
        try:
            client.wait_for_workers(1, timeout=wait)
        except (TimeoutError, OSError):
            raise DataError(f"no Dask worker joined the scheduler at {address} in {wait:g} s "
                            f"(--dask-wait); start workers with: dask worker {address}") from None
    target = _output_target(output)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        # Bounded: a worker that hangs must not make this check wait forever either.
        needed = tuple(dict.fromkeys((*WORKER_MODULES, *modules)))
        answers = pool.submit(client.run, _probe(), needed, target,
                              on_error="return").result(timeout=wait)
    except concurrent.futures.TimeoutError:
        raise DataError(f"the Dask workers at {address} did not answer a check in {wait:g} s "
                        f"(--dask-wait)") from None
    except Exception as exc:
        raise DataError(f"cannot check the Dask workers at {address} "
                        f"({one_line(exc, 200)})") from None
    finally:
        pool.shutdown(wait=False)
    for worker, answer in sorted(answers.items()):
        if isinstance(answer, BaseException):
            answer = f"failed a check ({one_line(answer, 200)})"
        if answer:
            raise DataError(f"the Dask worker {worker} {answer}")
    log.info("%d Dask worker(s) at %s can run the units", len(answers), address)


def _output_target(output: str | os.PathLike | None) -> tuple[str, str] | None:
    """What a worker checks of the output: ("url", URL) or ("dir", the nearest directory at or
    above a local output that exists now)."""
    if output is None:
        return None
    where = storage.location(output)
    if isinstance(where, str):
        return ("url", where)
    where = where.absolute()
    existing = next((d for d in (where, *where.parents) if d.is_dir()), Path(where.anchor))
    return ("dir", str(existing))


def _probe() -> Callable[..., str | None]:
    """The check `check_workers` runs on each worker. A nested function, so that Dask sends it
    by value: a worker without popbert must still be able to load it to say so."""

    def probe(modules: tuple[str, ...], target: tuple[str, str] | None) -> str | None:
        import importlib
        import os

        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # a missing package, or one that fails to load
                return (f"cannot import {name} ({type(exc).__name__}: {exc}); install popbert "
                        f"with its data packages (pip install 'popbert[data,dask]') where "
                        f"the workers run")
        if target is None:
            return None
        kind, where = target
        if kind == "dir":
            if not os.path.isdir(where):
                return (f"does not see {where} (the output must be on a filesystem every "
                        f"worker shares)")
            if not os.access(where, os.W_OK | os.X_OK):
                return f"cannot write in {where} (permission denied)"
            return None
        from popbert.data import storage
        from popbert.data.errors import DataError

        try:
            storage.check_reachable(where)
        except DataError as exc:
            return f"cannot reach the output: {exc}"
        return None

    return probe
