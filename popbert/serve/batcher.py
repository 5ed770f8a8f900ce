"""Rows from concurrent requests batched by a token budget (`popbert serve`).

Every request's handler encodes its inputs as the batch predictors do (`popbert.serve.predict`)
and hands the rows to one `RowBatcher`, which runs the export on its own thread: it waits at most
`max_wait_ms` after the oldest waiting row for others to join, then runs the oldest row with the
waiting rows nearest to it in length (so long and short rows are not padded to each other), taken
from the rows that were waiting when the current round began (so no row waits behind a stream of
newer ones), as many as fit `max_batch_tokens` (rows times the
batch's longest row) with at most `max_padding` of their tokens padding. It waits only while
requests in flight have not handed their rows over yet: a lone client never waits.

On a CPU, batching saves little beyond the per-run overhead, while padding is computed work; so
the padding bound matters more than batch size. Each row's outputs are cut back to the row, so
what a request gets does not depend on who shared its batch; the model's threads do the work,
never the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from popbert.runtime.buckets import pad_positions
from popbert.serve.predict import ExportedModel, PredictStats

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One `run` call: its rows, the outputs gathered so far, and who waits for them."""

    arrays: dict[str, np.ndarray]
    lengths: np.ndarray
    per_token: Mapping[str, float]
    wanted: tuple[str, ...]  # the outputs its caller asked for
    outputs: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    handed: float = 0.0  # time.monotonic() when its rows joined the queue
    first_run: float | None = None  # when the first model run with one of its rows began
    last_done: float = 0.0  # when the last such run ended


@dataclass
class _Row:
    """One row waiting: when it came, its place in arrival order, its length, and whose."""

    arrived: float
    sequence: int
    length: int
    job: _Job
    index: int


@dataclass
class BatchRecord:
    """What one model run did, for the metrics (`on_batch`)."""

    rows: int
    tokens: int  # real tokens in the rows
    computed: int  # rows x width actually run (padding included)
    seconds: float
    queued: int  # rows left waiting when it started


class RowBatcher:
    """Runs `model` on rows from many threads at once, in token-budgeted batches.

    `run` has `ExportedModel.run`'s signature and results, so a predictor whose `run` is this
    batcher's (`ExportedModel.batcher`) serves exactly what `popbert predict` computes.
    """

    def __init__(self, model: ExportedModel, max_batch_tokens: int = 16384,
                 max_wait_ms: float = 5.0, max_padding: float = 0.1,
                 on_batch: Callable[[BatchRecord], None] | None = None,
                 in_flight: Callable[[], int] | None = None,
                 max_rows: int | None = None) -> None:
        if max_batch_tokens < model.sequence_length:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must hold one row of the "
                             f"model's length ({model.sequence_length})")
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.max_padding = max_padding
        self.max_rows = max_rows  # rows in one run (None: as many as the bounds allow)
        self.in_flight = in_flight  # the server's requests in flight, for `_expecting`
        self._jobs = 0  # `run` calls between hand-over and answer
        self.on_batch = on_batch
        self._pending: list[_Row] = []
        self._sequence = 0
        self._round: set[int] = set()  # the rows (by sequence) of the round being run
        self._idle_since = 0.0  # when the last batch finished
        self._condition = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="popbert-batcher", daemon=True)
        self._thread.start()

    @property
    def queued_rows(self) -> int:
        """Rows waiting for a batch (the queue depth)."""
        return len(self._pending)

    def run(self, arrays: Mapping[str, np.ndarray], batch_size: int = 0,
            per_token: Mapping[str, float] | None = None, stats: PredictStats | None = None,
            bucket: bool = True, outputs: Sequence[str] | None = None
            ) -> dict[str, np.ndarray]:
        """The outputs named in `outputs` (default: the model's `default_outputs`) for the rows
        of `arrays` ([N, S] inputs), in the rows' order; outputs named in `per_token` padded
        back to S with its value, as `ExportedModel.run` gives them. A batch fetches what any
        of its rows' callers asked for.
        Blocks the calling thread until the rows have run (`batch_size` and `bucket` are the
        batcher's business here)."""
        arrays = {name: np.asarray(value) for name, value in arrays.items()}
        lengths = arrays["input_mask"].sum(axis=1).astype(np.int64)
        job = _Job(arrays, lengths, dict(per_token or {}),
                   tuple(self.model.default_outputs if outputs is None else outputs))
        rows = len(lengths)
        if rows:
            with self._condition:
                if self._closed:
                    raise RuntimeError("the batcher is closed")
                now = job.handed = time.monotonic()
                for index in range(rows):
                    self._sequence += 1
                    self._pending.append(_Row(now, self._sequence, max(1, int(lengths[index])),
                                              job, index))
                self._jobs += 1
                self._condition.notify()
            try:
                job.done.wait()
            finally:
                with self._condition:
                    self._jobs -= 1
            if job.error is not None:
                raise job.error
        if stats is not None:
            stats.rows += rows
            stats.tokens += int(lengths.sum())
            stats.runtime = self.model.runtime
            if job.first_run is not None:
                stats.handed_over = stats.handed_over or job.handed
                stats.queue_seconds += job.first_run - job.handed
                stats.model_seconds += job.last_done - job.first_run
        return self._assemble(job, rows)

    def _assemble(self, job: _Job, rows: int) -> dict[str, np.ndarray]:
        full = next(iter(job.arrays.values())).shape[1]
        result: dict[str, np.ndarray] = {}
        for name in job.wanted:
            parts = [job.outputs[index][name] for index in range(rows)]
            # A per-token output ([width, ...] per row) is padded back to the rows' length, S:
            # with its fill where the caller named one, else 0.
            if name in job.per_token or len({part.shape for part in parts}) > 1:
                fill = job.per_token.get(name, 0.0)
                parts = [pad_positions(part, full, fill, axis=0) for part in parts]
            if parts:
                result[name] = np.stack(parts)
            else:
                result[name] = np.zeros((0,), np.float32)
        masked = job.arrays["input_mask"] == 0
        for name, fill in job.per_token.items():
            if name in result and rows:
                result[name][masked] = fill
        return result

    def close(self) -> None:
        """Stop the thread after the rows already waiting have run."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._thread.join()

    # --- the batching thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._pending and not self._closed:
                    self._condition.wait()
                if not self._pending and self._closed:
                    return
                oldest = min(row.arrived for row in self._pending)
                # Rows that queued while the last batch ran mean a backlog: waiting then only
                # idles the model. The wait is for a burst reaching an idle batcher.
                deadline = oldest + self.max_wait if oldest >= self._idle_since else oldest
                while (not self._closed and self._waiting_tokens() < self.max_batch_tokens
                       and self._expecting() and time.monotonic() < deadline):
                    self._condition.wait(max(0.0, deadline - time.monotonic()))
                chosen = self._choose()
                queued = len(self._pending)
            self._run_batch(chosen, queued)
            self._idle_since = time.monotonic()

    def _expecting(self) -> bool:
        """Whether more rows are on their way: requests in flight that have not handed theirs
        over yet (always, when the server does not say). A lone client does not wait."""
        return self.in_flight is None or self.in_flight() > self._jobs

    def _waiting_tokens(self) -> int:
        return sum(row.length for row in self._pending)

    def _choose(self) -> list[_Row]:
        """The oldest row of the round and its nearest neighbours by length in the round that
        fit the budget (rows x the longest of them) and the padding bound; removed from the
        queue. A round is the rows waiting when it starts: they all run before any row that
        came later, so a row of an unusual length is never overtaken by newer rows of common
        ones (no row waits more than two rounds)."""
        # A fixed-batch export runs exactly its batch; `max_rows` may bound it further.
        limits = [n for n in (self.model.batch_size, self.max_rows) if n is not None]
        limit = min(limits) if limits else None
        full = None if self.model.dynamic_sequence else self.model.sequence_length
        if not self._round:
            self._round = {row.sequence for row in self._pending}
        by_length = sorted((row for row in self._pending if row.sequence in self._round),
                           key=lambda row: (row.length, row.sequence))
        oldest = min(range(len(by_length)), key=lambda i: by_length[i].sequence)
        low = high = oldest  # the chosen rows are by_length[low:high + 1]
        real = by_length[oldest].length  # their tokens
        while True:
            count = high - low + 2
            if limit is not None and count > limit:
                break
            options = []
            if low > 0:
                options.append((by_length[oldest].length - by_length[low - 1].length, -1))
            if high + 1 < len(by_length):
                options.append((by_length[high + 1].length - by_length[oldest].length, 1))
            if not options:
                break
            _, side = min(options)
            added = by_length[high + 1] if side == 1 else by_length[low - 1]
            longest = max(added.length, by_length[high].length)
            if count * (full or longest) > self.max_batch_tokens:
                break
            # padding is computed work: keep it under max_padding
            if full is None and 1 - (real + added.length) / (count * longest) > self.max_padding:
                break
            real += added.length
            if side == 1:
                high += 1
            else:
                low -= 1
        chosen = by_length[low:high + 1]
        taken = {row.sequence for row in chosen}
        self._pending = [row for row in self._pending if row.sequence not in taken]
        self._round -= taken
        return chosen

    def _run_batch(self, chosen: list[_Row], queued: int) -> None:
        model = self.model
        width = max(row.length for row in chosen) if model.dynamic_sequence \
            else model.sequence_length
        rows = list(chosen)
        if model.batch_size is not None:  # pad a fixed-batch export with copies of the last row
            rows += [rows[-1]] * (model.batch_size - len(rows))
        feeds = {name: np.ascontiguousarray(np.stack([row.job.arrays[name][row.index, :width]
                                                      for row in rows]))
                 for name in chosen[0].job.arrays if name in model.input_names}
        started = time.monotonic()
        for row in chosen:
            if row.job.first_run is None:
                row.job.first_run = started
        wanted = {name for row in chosen for name in row.job.wanted}
        try:
            outputs = model.forward(feeds, [name for name in model.output_names
                                            if name in wanted])
        except BaseException as error:  # every waiting request gets it; the thread goes on
            log.exception("a batch of %d rows failed", len(chosen))
            for row in chosen:
                row.job.error = error
                row.job.done.set()
            return
        finished = time.monotonic()
        seconds = finished - started
        for position, row in enumerate(chosen):
            row.job.last_done = finished
            row.job.outputs[row.index] = {name: np.asarray(outputs[name][position], np.float32)
                                          for name in row.job.wanted}
            if len(row.job.outputs) == len(row.job.lengths):
                row.job.done.set()
        if self.on_batch is not None:
            self.on_batch(BatchRecord(len(chosen), sum(row.length for row in chosen),
                                      len(rows) * width, seconds, queued))


__all__ = ["BatchRecord", "RowBatcher"]
