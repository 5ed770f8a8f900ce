"""`RowBatcher`: rows from many threads run together within the token budget, each caller gets
exactly its own rows' outputs (per-token outputs padded back with their fill), a fixed-batch
export gets its whole batch, the oldest row is never left behind, and a failing run reaches
every caller waiting on it while the batcher goes on. A stand-in model whose outputs depend on
each row alone makes the expected values exact, and holding its first run shows what queued
behind it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from popbert.serve.batcher import RowBatcher


class Model:
    """Rows in, per row: `embedding` = [sum of its ids, its length], `logits` = ids + 0.5 per
    token. `hold` stops the first run until released."""

    runtime = "stand-in"
    input_names = {"input_ids", "input_mask", "segment_ids"}
    output_names = ["embedding", "logits"]
    default_outputs = output_names

    def __init__(self, sequence_length: int = 16, batch_size: int | None = None,
                 dynamic: bool = True) -> None:
        self.sequence_length = sequence_length
        self.batch_size = batch_size
        self.dynamic_sequence = dynamic
        self.calls: list[tuple[int, int]] = []  # (rows, width) of each run
        self.fetched: list[list[str]] = []  # the outputs each run was asked for
        self.hold = threading.Event()
        self.held = threading.Event()
        self.hold.set()
        self.fail_next = False

    def forward(self, feeds, outputs=None):
        ids, mask = feeds["input_ids"], feeds["input_mask"]
        self.calls.append(ids.shape)
        self.fetched.append(list(outputs))
        self.held.set()
        self.hold.wait(30)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the runtime failed")
        every = {"embedding": np.stack([(ids * mask).sum(1), mask.sum(1)], 1).astype(np.float32),
                 "logits": (ids + 0.5).astype(np.float32)[..., None]}
        return {name: every[name] for name in outputs}


def rows(lengths: list[int], width: int = 16, first_id: int = 1) -> dict[str, np.ndarray]:
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = np.arange(first_id, first_id + length) + row
        mask[row, :length] = 1
    return {"input_ids": ids, "input_mask": mask, "segment_ids": np.zeros_like(ids)}


def expected(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = arrays["input_ids"], arrays["input_mask"]
    embedding = np.stack([(ids * mask).sum(1), mask.sum(1)], 1)
    logits = np.where(mask == 1, ids + 0.5, -7.0)[..., None]
    return embedding, logits


def queued_behind_a_run(requests: dict[int, dict[str, np.ndarray]],
                        outputs: dict[int, list[str] | None] | None = None
                        ) -> tuple[Model, dict[int, dict[str, np.ndarray]]]:
    """Each request's answer (and the model's runs) when request 0 is running as all the
    others queue (`outputs`: what each caller asks for; default: the model's)."""
    model = Model()
    batcher = RowBatcher(model, max_batch_tokens=1000, max_wait_ms=0, max_padding=1.0)
    model.hold.clear()
    results: dict[int, dict[str, np.ndarray]] = {}

    def ask(i: int) -> None:
        results[i] = batcher.run(requests[i], per_token={"logits": -7.0},
                                 outputs=(outputs or {}).get(i))

    first = threading.Thread(target=ask, args=(0,))
    first.start()
    model.held.wait(30)  # request 0 is running; the others queue behind it
    others = [threading.Thread(target=ask, args=(i,)) for i in requests if i != 0]
    for thread in others:
        thread.start()
    waiting = sum(len(arrays["input_mask"]) for i, arrays in requests.items() if i != 0)
    while batcher.queued_rows < waiting:
        threading.Event().wait(0.01)
    model.hold.set()
    for thread in [first, *others]:
        thread.join(30)
    batcher.close()
    return model, results


def test_rows_queued_behind_a_run_go_together_and_get_their_own_outputs() -> None:
    requests = {i: rows([1 + (i * 5) % 13, 2 + i % 3], first_id=10 * i) for i in range(6)}
    model, results = queued_behind_a_run(requests)
    assert [rows_ for rows_, _ in model.calls] == [2, 10]  # one run for all that queued
    for i, arrays in requests.items():
        embedding, logits = expected(arrays)
        np.testing.assert_array_equal(results[i]["embedding"], embedding)
        np.testing.assert_array_equal(results[i]["logits"], logits)  # padded back to 16


def test_a_run_fetches_what_its_rows_callers_asked_for_and_each_gets_only_that() -> None:
    """An output fetched on request (an embedding export's token states) is fetched for a
    batch only when one of its callers named it, and reaches only the callers that did."""
    asked = {0: ["embedding"], 1: ["embedding"], 2: ["logits"], 3: None}
    requests = {i: rows([3 + i, 4], first_id=10 * i) for i in asked}
    model, results = queued_behind_a_run(requests, asked)
    assert model.fetched == [["embedding"], ["embedding", "logits"]]
    assert {i: sorted(result) for i, result in results.items()} == {
        0: ["embedding"], 1: ["embedding"], 2: ["logits"], 3: ["embedding", "logits"]}
    for i, result in results.items():
        embedding, logits = expected(requests[i])
        for name, value in (("embedding", embedding), ("logits", logits)):
            if name in result:
                np.testing.assert_array_equal(result[name], value)


def test_the_token_budget_bounds_every_run_and_similar_lengths_go_together() -> None:
    model = Model(sequence_length=16)
    batcher = RowBatcher(model, max_batch_tokens=32, max_wait_ms=50, max_padding=1.0)
    lengths = [16, 2, 3, 15, 2, 16, 3, 14]
    arrays = rows(lengths)
    out = batcher.run(arrays)
    batcher.close()
    assert all(count * width <= 32 for count, width in model.calls)
    assert sum(count for count, _ in model.calls) == len(lengths)
    # the oldest row (16) with its nearest in length, then the oldest left (2) with the short
    # ones, then the rest: long and short rows are never padded to each other
    assert model.calls == [(2, 16), (4, 3), (2, 15)]
    np.testing.assert_array_equal(out["embedding"], expected(arrays)[0])


def test_a_fixed_export_runs_its_whole_batch_at_its_length() -> None:
    model = Model(sequence_length=16, batch_size=4, dynamic=False)
    batcher = RowBatcher(model, max_batch_tokens=1000, max_wait_ms=0)
    arrays = rows([3, 5, 7, 2, 9, 4])
    out = batcher.run(arrays)
    batcher.close()
    assert all(shape == (4, 16) for shape in model.calls)
    np.testing.assert_array_equal(out["embedding"], expected(arrays)[0])


def test_a_failed_run_reaches_its_callers_and_the_batcher_goes_on() -> None:
    model = Model()
    batcher = RowBatcher(model, max_batch_tokens=1000, max_wait_ms=0)
    model.fail_next = True
    with pytest.raises(RuntimeError, match="the runtime failed"):
        batcher.run(rows([3, 4]))
    arrays = rows([5])
    np.testing.assert_array_equal(batcher.run(arrays)["embedding"], expected(arrays)[0])
    batcher.close()


def test_a_budget_below_one_row_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        RowBatcher(Model(sequence_length=64), max_batch_tokens=32)


def test_rows_far_apart_in_length_run_apart_within_max_padding() -> None:
    model = Model(sequence_length=16)
    batcher = RowBatcher(model, max_batch_tokens=1000, max_wait_ms=0, max_padding=0.1)
    lengths = [16, 15, 4, 4, 3, 14, 16]
    arrays = rows(lengths)
    out = batcher.run(arrays)
    batcher.close()
    # (16, 16, 15, 14): 5 of 64 tokens padding; (4, 4, 3): 1 of 12
    assert sorted(model.calls) == [(3, 4), (4, 16)]
    np.testing.assert_array_equal(out["embedding"], expected(arrays)[0])


def test_a_lone_request_does_not_wait_for_others() -> None:
    """With the server saying no other request is on its way, a row runs at once, however long
    `max_wait_ms`; while one is on its way, the batch waits for it."""
    model = Model()
    on_the_way = [0]
    batcher = RowBatcher(model, max_batch_tokens=1000, max_wait_ms=60_000, max_padding=1.0,
                         in_flight=lambda: batcher._jobs + on_the_way[0])
    arrays = rows([3])
    np.testing.assert_array_equal(batcher.run(arrays)["embedding"], expected(arrays)[0])
    on_the_way[0] = 1
    done = threading.Event()
    threading.Thread(target=lambda: (batcher.run(rows([4])), done.set())).start()
    assert not done.wait(0.3)  # held for the request on its way
    second = rows([5])
    on_the_way[0] = 0
    np.testing.assert_array_equal(batcher.run(second)["embedding"], expected(second)[0])
    assert done.wait(30)
    assert model.calls[-1] == (2, 5)  # they ran together
    batcher.close()


def test_max_rows_bounds_every_run() -> None:
    model = Model()
    batcher = RowBatcher(model, max_batch_tokens=1000, max_wait_ms=0, max_padding=1.0,
                         max_rows=2)
    arrays = rows([3, 4, 5, 6, 7])
    out = batcher.run(arrays)
    batcher.close()
    assert [count for count, _ in model.calls] == [2, 2, 1]
    np.testing.assert_array_equal(out["embedding"], expected(arrays)[0])
