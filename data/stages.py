"""Machinery shared by the `prepare-data` stages: stage directories, parts, a bounded worker pool
(local processes, or a Dask cluster: `popbert.data.cluster`).

Every stage turns numbered input parts into numbered output parts, one work unit per part, so
that memory is bounded by the part size, results do not depend on the number of workers and an
interrupted run resumes. The guarantees in full: docs/design.md, section "popbert.data.stages".
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

from tqdm import tqdm

from popbert.data import storage
from popbert.data.errors import DataError
from popbert.data.storage import Location
from popbert.errors import one_line
from popbert.locking import DirectoryLock, lock_directory
from popbert.machine import usable_cpus

log = logging.getLogger(__name__)

STAGE_FILE = "_stage.json"
SUCCESS_FILE = "_SUCCESS.json"


def part_name(index: int, suffix: str) -> str:
    """`part-00042.<suffix>`: zero-padded so lexical order is numeric order."""
    return f"part-{index:05d}.{suffix}"


def default_workers() -> int:
    """All CPUs this process may use (the affinity mask and a container's CPU quota, not the
    machine's count)."""
    return usable_cpus()


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed for one work unit: a stable hash of the run's seed and the unit's indices.

    Seeds of neighbouring units are unrelated (not seed+1, seed+2), and the value does not
    depend on Python's hash randomisation or on the process that computes it.
    """
    import numpy as np

    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, *map(int, parts)])
    return int(state.generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> np.uint64(1))


class StageDir:
    """One stage's output directory with its parameter record and completion marker.

    From `open` to `finish` (or `abandon`) the directory is locked (`.lock`,
    `popbert.locking`): a stage resumes what an earlier run left, but two
    processes writing the same parts at once would each count the other's, so the second
    stops with one line naming the first.

    The directory may be a URL prefix on object storage (`s3://bucket/wiki/sentences`): parts
    and records are then objects, each published whole (`popbert.data.storage.publish`), and
    nothing is locked (object stores have no locks: run one stage per prefix at a time)."""

    def __init__(self, path: str | os.PathLike, stage: str, params: Mapping[str, Any]):
        where = storage.location(path)
        # Absolute: jobs carry it to workers with other working directories.
        self.path: Location = where.absolute() if isinstance(where, Path) else where
        self.stage = stage
        self.params = json.loads(json.dumps(dict(params), sort_keys=True, default=str))
        # Directories `open` created (deepest first): what `abandon` may remove again.
        self.created: list[Path] = []
        self._fresh_prefix = False  # a URL prefix that held nothing before this run
        self._lock: DirectoryLock | None = None

    def open(self) -> StageDir:
        """Create the directory, or check that an existing one was made with these parameters;
        either way, lock it."""
        if isinstance(self.path, str):  # a prefix: nothing to create, nothing to lock
            self._fresh_prefix = not storage.list_parts(self.path, "*", directories=True)
        else:
            missing = [d for d in (self.path, *self.path.parents) if not d.exists()]
            self.path.mkdir(parents=True, exist_ok=True)
            self.created = missing
            self._lock = lock_directory(self.path)
        try:
            self._check_or_record()
        except BaseException:
            self._remove_created()
            raise
        return self

    def _check_or_record(self) -> None:
        record = storage.join(self.path, STAGE_FILE)
        if storage.exists(record):
            try:
                old = json.loads(storage.read_bytes(record).decode("utf-8"))
            except (OSError, ValueError) as exc:
                raise DataError(f"{record}: unreadable stage record ({exc})") from None
            if old.get("stage") != self.stage or old.get("params") != self.params:
                diff = sorted(k for k in set(old.get("params", {})) | set(self.params)
                              if old.get("params", {}).get(k) != self.params.get(k))
                detail = ", ".join(f"{k}: {old.get('params', {}).get(k)!r} -> "
                                   f"{self.params.get(k)!r}" for k in diff[:3])
                raise DataError(f"{self.path}: made by a {old.get('stage')} run with other "
                                f"parameters ({detail or 'stage differs'}); use another output "
                                f"directory or delete this one")
        else:
            _write_json(record, {"stage": self.stage, "params": self.params})

    def release(self) -> None:
        """Unlock the directory (`finish` and `abandon` do; idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def complete(self) -> bool:
        return storage.exists(storage.join(self.path, SUCCESS_FILE))

    def success(self) -> dict:
        """The completion record (parts and statistics) of a finished stage."""
        record = storage.join(self.path, SUCCESS_FILE)
        try:
            return json.loads(storage.read_bytes(record).decode("utf-8"))
        except (OSError, ValueError) as exc:
            raise DataError(f"{record}: unreadable ({exc})") from None

    def finish(self, parts: list[str], stats: Mapping[str, Any]) -> dict:
        """Mark the stage complete; only now may later stages (or re-runs) trust it whole."""
        record = {"stage": self.stage, "parts": parts, "stats": dict(stats)}
        _write_json(storage.join(self.path, SUCCESS_FILE), record, sort_keys=False)
        self.release()
        return record

    def abandon(self, message: str) -> DataError:
        """The error for a stage that produced nothing, after removing what this run created.

        A directory this run made holds only its own parts, temporary files and record; they go,
        and so do the directories (then empty) made for it. A directory that existed before is
        left as it was. Either way no completion marker is written. Use `raise stage.abandon(...)`.
        """
        self._remove_created()
        return DataError(message)

    def _remove_created(self) -> None:
        """`abandon`'s clean-up; the lock goes too."""
        if isinstance(self.path, str):
            if self._fresh_prefix:
                for part in [*storage.list_parts(self.path, "part-*"),
                             storage.join(self.path, STAGE_FILE)]:
                    storage.remove(part)
            return
        if self.created:
            for child in self.path.iterdir():
                if child.name == STAGE_FILE or child.name.lstrip(".").startswith("part-"):
                    with contextlib.suppress(FileNotFoundError):
                        child.unlink()
        self.release()  # its file goes with it, before the directories
        for directory in self.created:
            try:
                directory.rmdir()
            except OSError:  # something else was put there meanwhile: keep it
                log.warning("%s: not removed (not empty)", directory)
                break
        self.created = []

    def pending(self, inputs: list[Location], suffix: str
                ) -> list[tuple[int, Location, Location]]:
        """(index, input part, output part) for each input whose output is not written yet.

        A part only exists under its final name once complete, so this is what a re-run of an
        interrupted stage still has to do.
        """
        done = {storage.name_of(p) for p in self.parts(suffix)}
        sources = [storage.location(src) for src in inputs]
        return [(i, src.absolute() if isinstance(src, Path) else src,
                 storage.join(self.path, part_name(i, suffix)))
                for i, src in enumerate(sources) if part_name(i, suffix) not in done]

    def parts(self, suffix: str) -> list[Location]:
        """Complete parts present now (temporary files start with a dot and are not listed)."""
        return storage.list_parts(self.path, f"part-*.{suffix}")


def _write_json(path: Location, record: Mapping[str, Any], sort_keys: bool = True) -> None:
    storage.write_bytes(path, (json.dumps(record, indent=1, sort_keys=sort_keys) + "\n").encode())


@contextlib.contextmanager
def atomic_output(path: Location) -> Iterator[Path]:
    """Yield a local temporary path to write; on success publish it as `path` (fsync and
    rename, or one PUT of the object)."""
    path = storage.location(path)
    tmp = storage.temp_path(path)
    try:
        yield tmp
        storage.publish(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _init_worker(single_threaded_tokenizers: bool) -> None:
    # Several processes each running a Rust thread pool on the same cores only thrash.
    if single_threaded_tokenizers:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    logging.getLogger("popbert").setLevel(logging.WARNING)


def _pool_context() -> multiprocessing.context.BaseContext:
    """`fork` where available: workers start instantly and, unlike `spawn`, a user's script
    needs no `if __name__ == "__main__"` guard. Elsewhere (macOS, Windows) `spawn`."""
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def workers_label(workers: int) -> str:
    """What runs a stage's units, for its log line: `N worker(s)` or the Dask cluster."""
    from popbert.data.cluster import active_cluster

    cluster = active_cluster()
    if cluster is not None:
        return f"the Dask cluster at {cluster.scheduler.address}"
    return f"{workers} worker(s)"


def _on_worker(fn: Callable[..., Any], *job: Any) -> Any:
    """`fn(*job)` in a Dask worker, set up as the local pool's workers are."""
    _init_worker(True)
    return fn(*job)


def run_units(fn: Callable[..., Any], jobs: Iterable[tuple], workers: int, desc: str,
              unit: str = "part", total: int | None = None,
              on_result: Callable[[tuple, Any], None] | None = None,
              progress: Callable[[Any], int] | None = None, show_bar: bool = True) -> list[Any]:
    """Run `fn(*job)` for every job: on the Dask cluster of an enclosing
    `popbert.data.cluster.on_cluster` block, else over `workers` processes (in-process when 1).

    Jobs are consumed lazily with at most twice as many in flight as there are worker processes
    (or cluster threads), so a generator of large jobs (e.g. pages streamed from a dump) never
    piles up in memory. Results come back in job order. `progress(result)` gives the amount to
    advance the bar by (default 1 per job); `show_bar=False` when the caller keeps its own bar.
    A job's paths must be absolute when they go to a cluster (its workers have their own
    working directories): the stages make them so.
    """
    from popbert.data.cluster import active_cluster

    results: dict[int, Any] = {}
    bar: tqdm | None = None

    def done(index: int, job: tuple, result: Any) -> None:
        nonlocal bar
        results[index] = result
        if on_result is not None:
            on_result(job, result)
        if not show_bar:
            return
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)
        bar.update(progress(result) if progress else 1)

    cluster = active_cluster()
    try:
        if cluster is not None:
            _run_on_cluster(cluster, functools.partial(_on_worker, fn), jobs, done, desc, total)
        elif workers <= 1:
            for i, job in enumerate(jobs):
                done(i, job, fn(*job))
        else:
            # The progress bar (and its monitor thread) starts after the workers are forked.
            with ProcessPoolExecutor(workers, mp_context=_pool_context(),
                                     initializer=_init_worker, initargs=(True,)) as pool:
                _run_pooled(pool, fn, jobs, done, lambda: 2 * workers)
    finally:
        if bar is not None:
            bar.close()
    return [results[i] for i in range(len(results))]


#: How long a stage on a Dask cluster waits for a unit before it looks at the workers again, and
#: how often it says how far it is.
POLL_S = 1.0
PROGRESS_EVERY_S = 30.0


def _run_on_cluster(client: Any, fn: Callable[..., Any], jobs: Iterable[tuple],
                    done: Callable[[int, tuple, Any], None], desc: str,
                    total: int | None) -> None:
    """`_run_pooled` on a Dask cluster, watching it: the number of workers connected and the
    units done are said as they change (and every `PROGRESS_EVERY_S`), and a cluster left
    without any worker for `cluster_wait()` seconds (all left or died, none joined) is a
    DataError saying how far the stage got, instead of a wait without end."""
    from popbert.data.cluster import cluster_slots, cluster_wait, worker_count

    address = client.scheduler.address
    patience = cluster_wait()
    executor = client.get_executor(pure=False)
    pending: dict[Future, tuple[int, tuple]] = {}
    state = {"finished": 0, "workers": worker_count(client), "alone_since": None,
             "said": time.monotonic()}

    def units() -> str:
        return f"{state['finished']}" + (f" of {total}" if total is not None else "")

    def watch() -> None:
        now = time.monotonic()
        workers = worker_count(client)
        if workers != state["workers"]:
            log.info("%s: %d Dask worker(s) connected to %s now; %s unit(s) done", desc,
                     workers, address, units())
            state["workers"] = workers
        if workers:
            state["alone_since"] = None
        elif state["alone_since"] is None:
            state["alone_since"] = now
            log.warning("%s: no Dask worker is connected to %s; waiting up to %g s for one to "
                        "join (--dask-wait)", desc, address, patience)
        elif now - state["alone_since"] >= patience:
            raise DataError(f"{desc}: no Dask worker connected to the scheduler at {address} "
                            f"for {patience:g} s (--dask-wait): all left or died and none "
                            f"joined; {units()} unit(s) done, the rest not run")
        if now - state["said"] >= PROGRESS_EVERY_S:
            log.info("%s: %s unit(s) done on %d Dask worker(s)", desc, units(), workers)
            state["said"] = now

    def drain(block_until: int) -> None:
        while len(pending) > block_until:
            finished, _ = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for future in finished:
                index, job = pending.pop(future)
                done(index, job, _unit_result(future, desc, client))
                state["finished"] += 1
            watch()

    try:
        for i, job in enumerate(jobs):
            with _cluster_failures(desc, client):  # a client given up on its scheduler refuses
                future = executor.submit(fn, *job)
            pending[future] = (i, job)
            drain(2 * cluster_slots(client))
        drain(0)
    finally:
        with contextlib.suppress(Exception):  # a lost scheduler: nothing left to cancel
            executor.shutdown(wait=False)


def _unit_result(future: Future, desc: str, client: Any) -> Any:
    """A cluster unit's result; the cluster's own failures as one DataError line (a unit's
    errors in its code are raised as they are)."""
    with _cluster_failures(desc, client):
        return future.result()


@contextlib.contextmanager
def _cluster_failures(desc: str, client: Any) -> Iterator[None]:
    """The block's exception as one DataError line when the cluster, not a unit's code,
    failed: the scheduler gone (the client reconnecting or given up), or a unit lost with its
    worker; anything else (a unit's own error, a DataError) is raised as it is."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        address = client.scheduler.address
        if client.status != "running":
            reason = f": {one_line(exc, 200)}" if str(exc) else ""
            raise DataError(f"{desc}: lost the Dask scheduler at {address} "
                            f"({type(exc).__name__}{reason})") from None
        if type(exc).__name__ in ("KilledWorker", "FutureCancelledError", "CancelledError"):
            raise DataError(f"{desc}: a unit was lost on the Dask cluster at {address}: "
                            f"{one_line(exc, 300)}") from None
        raise


def _run_pooled(executor: Executor, fn: Callable[..., Any], jobs: Iterable[tuple],
                done: Callable[[int, tuple, Any], None], in_flight: Callable[[], int]) -> None:
    """Submit the jobs to `executor`, at most `in_flight()` at a time, calling `done` as each
    finishes; the first failure is raised."""
    pending: dict[Future, tuple[int, tuple]] = {}

    def drain(block_until: int) -> None:
        while len(pending) > block_until:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                index, job = pending.pop(future)
                done(index, job, future.result())

    for i, job in enumerate(jobs):
        pending[executor.submit(fn, *job)] = (i, job)
        drain(in_flight())
    drain(0)
